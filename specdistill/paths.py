"""What a path in a config names, read before anything loads: a local file or folder (a typo there is a local
error, never a Hub lookup), and a chat template given inline or as a file. Knows nothing of configs or models: the
callers (validation.py, data/) pass the values."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from specdistill.assets import is_embedded

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".safetensors", ".gguf", ".yaml")


def looks_local(path: str, hub_ids_have_one_slash: bool = True) -> bool:
    """True when `path` can only mean a file or folder on this machine: ./x, ../x, ~/x, /x, a data-file suffix,
    or (hub ids being org/name) a path with two or more slashes. `embedded:*` and bare names are not local."""
    s = str(path)
    if not s or is_embedded(s) or "://" in s:
        return False
    if s.startswith(("/", "./", "../", "~", ".")) or s.lower().endswith(LOCAL_SUFFIXES):
        return True
    return hub_ids_have_one_slash and s.count("/") >= 2


def missing_local_path(key: str, path: str) -> Optional[str]:
    """An error line when `path` looks local but does not exist (checked instead of asking the Hub)."""
    if path and looks_local(path) and not Path(str(path)).expanduser().exists():
        where = Path(str(path)).expanduser()
        return (f"{key}={path!r} looks like a local path but {where.resolve() if not where.is_absolute() else where} "
                "does not exist (nothing is looked up on the Hub for a local-looking path): fix the path, or give "
                "a Hub id as org/name")
    return None


def resolve_chat_template(value: str) -> str:
    """data.chat_template -> Jinja source. An inline template (it contains `{{` or `{%`) is returned as is; anything
    else must be a file holding one. Pure (no tokenizer): path_errors calls it before anything loads, and
    data/chat.py installs the result on the tokenizer."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"data.chat_template={value!r} is neither an existing file nor a Jinja template (no '{{{{' "
                         "or '{%' in it): pass the path of a .jinja file or the template text itself")
    text = path.read_text()
    if "{{" not in text and "{%" not in text:
        raise ValueError(f"data.chat_template file {path} holds no Jinja template (no '{{{{' or '{{%'): point it "
                         "at a chat template, e.g. the `chat_template` of a tokenizer_config.json saved as a file")
    return text
