"""Config checks in one place, run by every entry point before any model or data is loaded (checked_config, which
entry.load_config completes with the objectives).

Knows nothing about models or tensors: it reads the config (and, for the few checks that need them, a draft or target
folder's config.json, the draft kinds' specs and whether torch sees CUDA). Hydra already refuses wrong types, unknown
keys given without `+` (and, since `recipe` is not optional in conf/config.yaml, an unknown recipe, listing the known
ones); what is left is checked here, first on the composed tree (what only it shows), then on the typed Config:
  - keys the schema does not have, appended with `+` (the schema is closed), with the nearest known key;
  - required values (`???` in a group YAML: data=jsonl needs data.path, target=local needs target.path);
  - a run_name that would put trainer.output_dir outside its parent folder is refused;
  - the range or choices of every constrained setting, read from the schema's fields (specdistill/constraints.py),
    the key named in the message;
  - paths that look local (./x, ~/x, /x, *.jsonl ...) must exist: a typo is a local error, never a Hub lookup;
  - data.chat_template must be an inline Jinja template or a file holding one;
  - draft sizes the chosen draft.init would ignore (draft.num_layers=2 for an EAGLE-3 head) are refused (the sizes
    each draft kind honours are on its spec, drafts/registry.py);
  - a data or prompt setting naming a folder where one file is read;
  - target.path naming a draft's folder (a checkpoint or an export its draft kind claims) is refused by name;
  - an eval.gamma (eval.max_gamma, eval.tree.depth) above what one proposal of the evaluated draft holds (its kind
    says: a DFlash block drafts block_size - 1);
  - eval.device=cuda on a machine or torch build without CUDA;
  - hub.push without hub.repo_id;
  - settings that another setting makes useless (eval.draft_path with eval.drafter=ngram) give a warning.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Callable, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from specdistill.assets import is_embedded
from specdistill.config import Config, HubConfig
from specdistill.constraints import field_errors
from specdistill.paths import missing_local_path, resolve_chat_template


class ConfigError(ValueError):
    """A config a run must not start with; the message names every bad key and how to fix it."""


def missing_keys(composed: DictConfig, prefix: str = "") -> list[str]:
    """Every `???` value left in the composed config (dotted keys)."""
    out = []
    for k in composed.keys():
        key = f"{prefix}{k}"
        if OmegaConf.is_missing(composed, k):
            out.append(key)
        else:
            v = composed._get_node(k)
            if isinstance(v, DictConfig):
                out.extend(missing_keys(v, key + "."))
    return out


REQUIRED_HINTS = {
    "data.path": "data=jsonl reads your own file: pass data.path=path/to/conversations.jsonl "
                 "(or drop data=jsonl to train on the embedded ShareGPT)",
    "target.path": "target=local loads your own model: pass target.path=/path/to/hf_model_folder (or a Hub id "
                   "org/name; or drop target=local for the embedded SmolLM2)",
    "draft.path": "draft=pretrained loads a draft model: pass draft.path=/path/to/hf_model_folder",
    "objective": "pick an objective: objective=kd (or a recipe: recipe=kd)",
}


def required_errors(composed: DictConfig) -> list[str]:
    return [f"{k} is required and not set: {REQUIRED_HINTS.get(k, f'pass {k}=<value>')}"
            for k in missing_keys(composed)]


def range_errors(cfg: Config) -> list[str]:
    """Every value outside the range or choices its schema field declares (specdistill/config.py), and the
    n-gram bounds out of order."""
    errors = field_errors(cfg, cls=Config)
    if cfg.eval.ngram_min > cfg.eval.ngram_max:
        errors.append(f"eval.ngram_min={cfg.eval.ngram_min} must be <= eval.ngram_max={cfg.eval.ngram_max}")
    return errors


def path_errors(cfg: Config) -> list[str]:
    """Local-looking paths that do not exist: the ones the run reads, and draft.path whenever it is set."""
    read = [("target.path", cfg.target.path), ("data.regenerate.prompts", cfg.data.regenerate.prompts)
            if cfg.data.regenerate.enabled else ("data.path", cfg.data.path), ("eval.prompts", cfg.eval.prompts)]
    read.append(("draft.path", cfg.draft.path))  # checked whenever set: the groups whose init ignores it leave it null
    if cfg.eval.drafter == "draft":
        read.append(("eval.draft_path", cfg.eval.draft_path))
    errors = []
    for key, v in read:
        if isinstance(v, str):
            e = missing_local_path(key, v)
            if e:
                errors.append(e)
    template = cfg.data.chat_template
    if isinstance(template, str) and template:
        try:
            resolve_chat_template(template)  # a file that does not exist and is no template either
        except ValueError as e:
            errors.append(str(e))
    return errors


def draft_shape_errors(cfg: Config) -> list[str]:
    """Draft sizes that the chosen draft.init would silently ignore: refused, naming the setting that does apply. The
    sizes each init honours and the layer count it must have are its draft kind's (drafts/registry.py: DraftKind)."""
    from specdistill.drafts import kind_for_init
    from specdistill.drafts.registry import SIZE_KEYS, inits_honouring

    init = cfg.draft.init
    try:
        kind = kind_for_init(init).spec
    except ValueError as e:  # an unknown init, named with the known ones
        return [str(e)]
    used, layers_needed = kind.inits[init], kind.num_layers
    errors = []
    layers = cfg.draft.num_layers
    if layers_needed is not None and layers != layers_needed:
        errors.append(f"draft.num_layers={layers}: a draft.init={init} draft has exactly {layers_needed} decoder "
                      "layer (the EAGLE-3 layout vLLM and SGLang load); set draft.num_layers=1 (draft=eagle3 does), "
                      "and give it capacity with draft.intermediate_size")
    for k in SIZE_KEYS:
        v = getattr(cfg.draft, k)
        if v is not None and k not in used:
            if used == ("intermediate_size",):
                fix = ("give the head capacity with draft.intermediate_size (its MLP width); its width and heads are "
                       "the target's")
            elif used:
                fix = f"a draft.init={init} draft takes {' and '.join(f'draft.{u}' for u in used)} only"
            else:
                fix = f"draft.{k} applies to draft.init={' | '.join(inits_honouring(k))}"
            errors.append(f"draft.{k}={v} is not used with draft.init={init}: drop draft.{k} ({fix})")
    return errors


def run_name_errors(composed: DictConfig) -> list[str]:
    """A run_name that trainer.output_dir interpolates must keep the run inside the output folder's parent
    (`outputs/${run_name}`): `..` parts or an absolute path would write elsewhere or nest a path under it. Read before
    the interpolation is resolved."""
    name = composed.get("run_name")
    raw = OmegaConf.to_container(composed.trainer, resolve=False).get("output_dir")
    if name is None or not isinstance(raw, str) or "${run_name}" not in raw:
        return []
    name = str(name)
    parent = raw.split("${run_name}")[0] or "."
    parts = Path(os.path.normpath(name)).parts if name else ()
    if parts and not os.path.isabs(name) and parts[0] not in (".", ".."):
        return []
    return [f"run_name={name!r} must name a folder inside {parent!r} (trainer.output_dir={raw}): use a plain name "
            "such as run_name=my_run, or set trainer.output_dir=<folder> to write somewhere else"]


def schema_keys(cls: type, prefix: str = "") -> dict[str, Optional[type]]:
    """Dotted key -> the config dataclass it holds (None for a leaf) for every field of the dataclass `cls`, nested
    dataclasses included. A field typed Any or dict holds free-form settings that its own owner checks."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Optional[type]] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        key = f"{prefix}{f.name}"
        out[key] = hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None
        if out[key] is not None:
            out.update(schema_keys(hint, key + "."))
    return out


def unknown_key_errors(composed: DictConfig) -> list[str]:
    """Keys the schema does not have. Hydra refuses them on a plain override, but `+key=value` (Hydra's own hint for
    a mistyped key) appends one, and the run would ignore it: the schema is closed, so it is refused here with the
    nearest known key."""
    known = schema_keys(Config)
    errors = []

    def walk(node: DictConfig, cls: type, prefix: str) -> None:
        names = {f.name for f in dataclasses.fields(cls)}
        for k in node.keys():
            key = f"{prefix}{k}"
            if k not in names:
                child = node._get_node(k)
                for leaf in (_leaves(child, key + ".") if isinstance(child, DictConfig) and len(child) else [key]):
                    errors.append(f"{leaf} is not a setting (the schema is closed: `+{leaf}=...` adds a key that "
                                  f"nothing reads): {nearest_key(leaf, known)}")
            elif known.get(key) is not None and isinstance(node._get_node(k), DictConfig):
                walk(node._get_node(k), known[key], key + ".")

    walk(composed, Config, "")
    return errors


def _leaves(node: DictConfig, prefix: str) -> list[str]:
    out = []
    for k in node.keys():
        child = node._get_node(k)
        out += _leaves(child, f"{prefix}{k}.") if isinstance(child, DictConfig) and len(child) else [f"{prefix}{k}"]
    return out


def nearest_key(key: str, known: Iterable[str]) -> str:
    """'did you mean X?' from the keys beside `key` first, then from every known key; else where they are listed."""
    known = list(known)
    parent = key.rpartition(".")[0]
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    name = key.rpartition(".")[2]
    close = difflib.get_close_matches(name, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.6)
    if close:
        return f"did you mean {parent + '.' if parent else ''}{close[0]}?"
    leaves = [k for k in known if not key.startswith(k + ".") and k != parent]  # never the key's own groups
    close = difflib.get_close_matches(key, leaves, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    where = f"the fields of {parent}" if parent else "the top-level groups"
    return f"see {where} in specdistill/config.py"


def draft_length_errors(cfg: Config) -> list[str]:
    """A draft whose proposals hold at most N tokens (its kind says: a DFlash block drafts block_size - 1): an
    eval.gamma (or eval.max_gamma with dynamic_gamma, or a tree deeper) above N would be cut silently, and the reports
    would show acceptance at positions never drafted. The draft is the one evaluated: the folder at eval.draft_path,
    else the one draft.init builds. Refused whenever real speculative decoding runs it (eval.spec_eval in training, or
    an evaluation of eval.draft_path); a sweep over eval.block_sizes sets gamma per block size itself."""
    from specdistill.drafts.registry import draft_length

    e = cfg.eval
    if e.drafter != "draft" or not (e.spec_eval or e.draft_path):
        return []
    length = draft_length(cfg.draft, Path(str(e.draft_path)).expanduser() if e.draft_path else None)
    if length is None:
        return []
    asked = [("eval.gamma", e.gamma)]
    if e.dynamic_gamma:
        asked.append(("eval.max_gamma", e.max_gamma))
    if e.tree.topk > 0:
        asked.append(("eval.tree.depth", e.tree.depth))
    return [f"{key}={value} exceeds {length.limit}: set {key}={length.most}, or {length.fix(value)}"
            for key, value in asked if value > length.most]


def target_errors(cfg: Config) -> list[str]:
    """target.path naming the folder of a draft (a checkpoint or an export that a registered draft kind claims):
    refused naming the kind, from its config.json alone."""
    from specdistill.drafts.registry import draft_in_folder
    from specdistill.models.target import refusal

    what = draft_in_folder(cfg.target.path)
    return [refusal(cfg.target.path, f"{what}: it drafts for a target and cannot be one")] if what else []


def device_errors(cfg: Config) -> list[str]:
    """eval.device=cuda[:N] on a machine (or a torch build) without CUDA, or a device index it does not have."""
    device = cfg.eval.device
    if not device.startswith("cuda"):
        return []
    import torch

    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "torch sees no CUDA device (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        return [f"eval.device={device}: {why}; set eval.device=cpu, or eval.device=auto (CUDA when present)"]
    index = str(device).partition(":")[2]
    if index.isdigit() and int(index) >= torch.cuda.device_count():
        return [f"eval.device={device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0; "
                "set eval.device=cuda:0 (or auto)"]
    return []


FILE_KEYS = ("data.path", "eval.prompts", "data.regenerate.prompts")  # each read as one file of rows


def folder_errors(cfg: Config) -> list[str]:
    """A data or prompt setting that names a folder where one file of rows is read, naming the files inside it."""
    errors, regen = [], cfg.data.regenerate.enabled
    values = {"data.path": cfg.data.path, "eval.prompts": cfg.eval.prompts,
              "data.regenerate.prompts": cfg.data.regenerate.prompts}
    for key in FILE_KEYS:
        value = values[key]
        if key == ("data.regenerate.prompts" if not regen else "data.path"):
            continue  # the source this run does not read
        if not isinstance(value, str) or is_embedded(value) or value == "heldout" or "://" in value:
            continue
        folder = Path(value).expanduser()
        if folder.is_dir():
            found = sorted(p.name for p in folder.iterdir() if p.suffix in (".json", ".jsonl", ".parquet"))[:5]
            hint = (f"it holds {', '.join(found)}: e.g. {key}={folder / found[0]}" if found
                    else "it holds no .json, .jsonl or .parquet file")
            errors.append(f"{key}={value!r} is a folder; it must name one .json, .jsonl or .parquet file ({hint})")
    return errors


def override_errors(args: Iterable[str]) -> list[str]:
    """Command-line overrides Hydra's lexer would refuse with only a caret under the character: a value with
    characters outside its unquoted grammar (non-ASCII letters, most often in a folder name) must be quoted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    errors = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue  # Hydra's own flags (--multirun, -cn ...)
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            key, _, value = arg.partition("=")
            odd = sorted({ch for ch in value if not ch.isascii()})
            if odd and not value.startswith(("'", '"', "[", "{")):
                errors.append(f"{arg}: Hydra reads an unquoted value only in plain ASCII; {''.join(odd)!r} needs the "
                              f"value quoted: pass '{key}=\"{value}\"' (the shell's single quotes around Hydra's "
                              "double quotes)")
    return errors


def warnings(cfg: Config) -> list[str]:
    out = []
    drafter, draft_path = cfg.eval.drafter, cfg.eval.draft_path
    if draft_path and drafter != "draft":
        out.append(f"eval.draft_path={draft_path!r} is ignored with eval.drafter={drafter!r} (only eval.drafter=draft "
                   "loads a draft): drop eval.draft_path, or set eval.drafter=draft to evaluate that draft")
    return out


def push_errors(hub: HubConfig) -> list[str]:
    """A push that cannot happen: hub.push without a repository."""
    return ["hub.push=true needs hub.repo_id=<user-or-org>/<name>"] if hub.push and not hub.repo_id else []


def hub_errors(cfg: Config) -> list[str]:
    return push_errors(cfg.hub)


COMPOSITION_CHECKS = (unknown_key_errors, required_errors, run_name_errors)  # on the composed tree, before conversion
CONFIG_CHECKS = (range_errors, path_errors, folder_errors, target_errors, draft_shape_errors, draft_length_errors,
                 device_errors, hub_errors)


def checked_config(composed: DictConfig, log: Optional[Callable[[str], None]] = print) -> Config:
    """The composed config as the typed Config, checked: the composition's own checks (keys the schema lacks, `???`
    values, run_name), the conversion, then every field's rule and the cross-field checks on the typed object.
    Raises ConfigError listing every problem at once (nothing is loaded); logs the warnings. entry.load_config adds
    the objectives."""
    _refuse([e for check in COMPOSITION_CHECKS for e in check(composed)])
    cfg = OmegaConf.to_object(composed)
    _refuse([e for check in CONFIG_CHECKS for e in check(cfg)])
    if log is not None:
        log_warnings(cfg, log)
    return cfg


def log_warnings(cfg: Config, log: Callable[[str], None]) -> None:
    for w in warnings(cfg):
        log(f"[config] warning: {w}")


def validate_config(composed: DictConfig, log: Optional[Callable[[str], None]] = print) -> list[str]:
    """checked_config's checks, for a command that only checks: the warnings (logged too)."""
    return warnings(checked_config(composed, log))


def _refuse(errors: list[str]) -> None:
    if not errors:
        return
    text = "bad config (nothing was loaded):\n  - " + "\n  - ".join(errors)
    if all("does not exist" in e for e in errors):
        raise FileNotFoundError(text)  # only missing files: the error callers of path checks expect
    raise ConfigError(text)
