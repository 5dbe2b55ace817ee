"""What a checkpoint was trained on, by content: a resume over changed inputs is refused by name.

Every checkpoint holds inputs.json: the digest of the data's bytes (the conversations file, or the prompts a
regenerated store answers), of the target's files (weights, config, tokenizer files), of offline features, the
tokenizer as it encodes (cache.tokenizer_digest) and its chat template, and the digest of the target's input
embeddings (export.embedding_digest, which evaluation checks: drafts/readback.py). These are the keys the data cache and
the regenerated store are made of (assets.source_digest, assets.model_digest), so a file edited in place, even to the
same size and modification time, or new weights in the same folder, read as another input. Knows nothing about the
training loop: it computes, records and compares.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from specdistill.config import DataConfig, RegenerateConfig, TargetConfig
from specdistill.drafts.readback import CHECKPOINT_INPUTS

# inputs.json keys a resume compares (the others name the inputs, or are implied by these)
CONTENT_KEYS = ("data_bytes", "offline_features", "target_files", "target_embeddings", "tokenizer", "chat_template")
# the key naming where each content key's input is: when that differs, the config names another input, which the
# config comparison on resume reports (train/checkpoint.py: check_resume_config) and this module leaves to it
NAMED_BY = {"data_bytes": "data_path", "offline_features": "offline_dir", "target_files": "target_path",
            "target_embeddings": "target_path", "tokenizer": "target_path", "chat_template": "chat_template_setting"}
ACCEPT = "trainer.resume_accept_changed_inputs"

_embedding_memo: dict[tuple, str] = {}


class InputsChanged(ValueError):
    """A resume whose inputs differ in content from the checkpoint's; the message names each and the fix."""


@dataclass
class InputChange:
    key: str          # an inputs.json key (CONTENT_KEYS)
    setting: str      # the config key that names the input, e.g. data.path
    where: str        # the input it names (a path, or the tokenizer of target.path)
    recorded: Any
    now: Any

    def line(self) -> str:
        return f"{self.setting}={self.where}: {_what(self.key)} {_short(self.recorded)} -> {_short(self.now)}"


def run_inputs(target: TargetConfig, data: DataConfig, tokenizer=None, embeddings: Optional[str] = None) -> dict:
    """The inputs of a run with these settings, by content. `embeddings`: target_embedding_digest of the loaded target
    (None leaves that key out)."""
    from specdistill.assets import model_digest, source_digest

    regen = data.regenerate.enabled
    data_setting = "data.regenerate.prompts" if regen else "data.path"
    data_path = str(data.regenerate.prompts if regen else data.path)
    out: dict[str, Any] = {"target_path": str(target.path), "target_files": model_digest(str(target.path)),
                           "data_setting": data_setting, "data_path": data_path, "data_bytes": source_digest(data_path)}
    offline = data.offline_dir
    if offline:
        from specdistill.cache import path_digest

        out["offline_dir"] = str(offline)
        out["offline_features"] = path_digest(offline)
    out["chat_template_setting"] = data.chat_template
    if tokenizer is not None:
        from specdistill.cache import tokenizer_digest

        out["tokenizer"] = tokenizer_digest(tokenizer)
        out["chat_template"] = getattr(tokenizer, "chat_template", None)
    if embeddings is not None:
        out["target_embeddings"] = embeddings
    return out


def inputs_from_yaml(config_yaml: str, tokenizer=None, embeddings: Optional[str] = None) -> dict:
    """run_inputs of a run's resolved config YAML; a config without target and data (a bare test config) gives {}."""
    import yaml

    raw = yaml.safe_load(config_yaml) or {}
    if not isinstance(raw.get("target"), dict) or not isinstance(raw.get("data"), dict):
        return {}
    data, regen = raw["data"], raw["data"].get("regenerate") or {}
    return run_inputs(TargetConfig(path=raw["target"]["path"]),
                      DataConfig(path=data.get("path"), offline_dir=data.get("offline_dir"),
                                 chat_template=data.get("chat_template"),
                                 regenerate=RegenerateConfig(enabled=bool(regen.get("enabled", False)),
                                                             prompts=regen.get("prompts"))),
                      tokenizer, embeddings)


def target_embedding_digest(target) -> Optional[str]:
    """export.embedding_digest of the target's input embeddings (V, H), remembered per tensor version; None when they
    are not whole on this process (a sharded target). A DTensor (FSDP2) is gathered: every process must call this."""
    import torch

    from specdistill.export import embedding_digest

    model = getattr(target, "model", target)  # models.target.Target wraps the HF model
    try:
        weight = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):  # no target, or one without input embeddings
        return None
    if hasattr(weight, "full_tensor"):  # a DTensor (FSDP2): every process gathers it
        weight = weight.full_tensor()
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or (vocab and weight.shape[0] != vocab):
        return None
    key = (id(weight), weight._version, weight.data_ptr(), tuple(weight.shape))
    if key not in _embedding_memo:
        _embedding_memo[key] = embedding_digest(weight)
    return _embedding_memo[key]


def write_inputs(folder: Path, inputs: dict) -> None:
    """folder/inputs.json (nothing when `inputs` is empty)."""
    if inputs:
        (Path(folder) / CHECKPOINT_INPUTS).write_text(json.dumps(inputs, indent=1, default=str))


def read_inputs(checkpoint: Path) -> Optional[dict]:
    """A checkpoint's inputs.json, or None where it has none (or it is unreadable)."""
    try:
        return json.loads((Path(checkpoint) / CHECKPOINT_INPUTS).read_text())
    except (OSError, ValueError):
        return None


def input_changes(recorded: dict, now: dict) -> list[InputChange]:
    """The content keys recorded in both whose values differ while the settings naming them are the same (an input
    changed in place), each naming its setting and input."""
    out = []
    for k in CONTENT_KEYS:
        if recorded.get(NAMED_BY[k]) != now.get(NAMED_BY[k]) or (k == "tokenizer" and recorded.get(
                "chat_template_setting") != now.get("chat_template_setting")):
            continue  # another input by name: the config comparison says so
        if k in recorded and k in now and recorded[k] != now[k]:
            setting, where = _named(k, now)
            out.append(InputChange(k, setting, where, recorded[k], now[k]))
    return out


def check_resume_inputs(checkpoint: Path, now: dict, accept: bool = False,
                        log: Callable[[str], None] = print) -> list[InputChange]:
    """Refuse (InputsChanged naming each changed input and the fixes) a resume from `checkpoint` whose recorded inputs
    differ from `now`, unless `accept`; then say what changed. A checkpoint without a record is said to be unchecked."""
    recorded = read_inputs(checkpoint)
    if recorded is None:
        if now:
            log(f"[train] resume: {checkpoint} records no {CHECKPOINT_INPUTS}: whether the data, target and tokenizer "
                "are those it was trained on cannot be checked")
        return []
    changes = input_changes(recorded, now)
    if changes and not accept:
        lines = "\n  - ".join(c.line() for c in changes)
        raise InputsChanged(
            f"trainer.resume: the inputs changed since {checkpoint} was written (its {CHECKPOINT_INPUTS} vs now):\n"
            f"  - {lines}\nResuming would continue training on other inputs than the steps before. Fix: restore "
            f"them, or start a fresh run in another trainer.output_dir (warm-started with "
            f"draft.path={Path(checkpoint) / 'draft'} if you want its weights), or pass {ACCEPT}=true to continue on "
            "the new inputs on purpose")
    if changes:
        log(f"[train] warning: {ACCEPT}=true: resuming over changed inputs: " + "; ".join(c.line() for c in changes))
    return changes


def _named(key: str, now: dict) -> tuple[str, str]:
    if key == "data_bytes":
        return now.get("data_setting", "data.path"), now.get("data_path", "?")
    if key == "offline_features":
        return "data.offline_dir", now.get("offline_dir", "?")
    return "target.path", now.get("target_path", "?")


def _what(key: str) -> str:
    return {"data_bytes": "its bytes", "offline_features": "its feature files", "target_files": "its files",
            "target_embeddings": "its input embeddings", "tokenizer": "its tokenizer",
            "chat_template": "its chat template"}[key]


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
