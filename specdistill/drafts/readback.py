"""Drafts read back as they were trained: a saved draft is checked against the target it will run with before any
decoding, and an EAGLE-3 folder without embed_tokens (a serving export) takes the target's embeddings.

Every kind: its adapter's check_target (the vocabulary it scores) must pass; a failure names the folder and the target
it was trained for (an export's `specdistill_target`, or the checkpoint's config.yaml). EAGLE-3 heads also need the
target's hidden size and enough layers for their aux ids, and their embeddings: kept when the folder holds them, else
the target's input embeddings, shape-checked, and digest-checked where the export recorded `embed_tokens_sha256`.
A draft whose checkpoint (inputs.json) or own config.json records the digest of its target's input embeddings runs
only with a target of the same embeddings (check_trained_target). A kind with more to check adds a function to
FITS. Knows nothing of the evaluator or training.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

CHECKPOINT_INPUTS = "inputs.json"  # beside a checkpoint's draft/ folder: what it was trained on (train/inputs.py)


def trained_for(path) -> Optional[str]:
    """The target a saved draft was trained for, where the folder says: an export's config.json
    (`specdistill_target`) or the checkpoint's config.yaml next to its draft/ folder (target.path)."""
    path = Path(path).expanduser()
    try:
        recorded = json.loads((path / "config.json").read_text()).get("specdistill_target")
    except (OSError, ValueError):
        recorded = None
    if recorded:
        return str(recorded)
    recorded = _checkpoint_inputs(path).get("target_path")
    if recorded:
        return str(recorded)
    run_cfg = path.parent / "config.yaml"
    if run_cfg.exists():
        from omegaconf import OmegaConf

        try:
            return str(OmegaConf.load(run_cfg).target.path)
        except Exception:  # an unreadable or foreign config.yaml: the folder just does not say
            return None
    return None


def _checkpoint_inputs(path) -> dict:
    """The inputs.json of the checkpoint holding the draft folder `path` ({} where there is none)."""
    try:
        return json.loads((Path(path).expanduser().parent / CHECKPOINT_INPUTS).read_text())
    except (OSError, ValueError):
        return {}


def check_trained_target(path, target_model, target_name: str = "the target", log=print) -> None:
    """A saved draft must run with the target it was trained for: where its checkpoint (inputs.json) or its own
    config.json (`embed_tokens_sha256`, a draft folder copied out of its checkpoint) recorded the digest of that
    target's input embeddings, this target's must be the same (a target of the same shape but other weights is
    refused by name). With no record, one line says the target cannot be checked."""
    from specdistill.export import embedding_digest

    where = Path(path).expanduser().parent / CHECKPOINT_INPUTS
    recorded = _checkpoint_inputs(path).get("target_embeddings")
    if not recorded:
        where = Path(path).expanduser() / "config.json"
        try:
            recorded = json.loads(where.read_text()).get("embed_tokens_sha256")
        except (OSError, ValueError):
            recorded = None
    if not recorded:
        if log is not None:
            log(f"[draft] {path} records no digest of its target's input embeddings: cannot check which target it "
                "was trained for")
        return
    now = embedding_digest(target_model.get_input_embeddings().weight)
    if now != recorded:
        raise _unfit(path, target_name, f"the target's input embeddings differ from those of the target it was "
                                        f"trained with (digest {now} != {recorded} recorded in {where})")


def _unfit(path, target_name: str, problem: str) -> ValueError:
    was = trained_for(path)
    origin = f"it was trained for {was}" if was else "its folder does not record the target it was trained for"
    return ValueError(f"the draft at {path} does not fit the target {target_name}: {problem}; {origin}. Fix: evaluate "
                      "it with the target it was trained for (target.path=...), or train a draft for this target")


def saved_tensor_names(path) -> set[str]:
    """The tensor names stored in a folder's *.safetensors files (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(path).expanduser().glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    return names


def fill_eagle3_embeddings(head, path, target_model, target_name: str = "the target", log=print) -> None:
    """An EAGLE-3 head loaded from `path`: when the folder holds no embed_tokens.weight (engines reuse the target's,
    so exports leave it out), copy the target's input embeddings in, after checking their shape and, where the
    export recorded one, their digest. Raises ValueError naming the folder otherwise."""
    from specdistill.export import embedding_digest

    if "embed_tokens.weight" in saved_tensor_names(path):
        return
    emb = target_model.get_input_embeddings().weight  # (V, H)
    want = tuple(head.embed_tokens.weight.shape)
    if tuple(emb.shape) != want:
        raise _unfit(path, target_name, f"the folder has no embed_tokens and the target's embeddings are "
                                        f"{list(emb.shape)}, the head needs {list(want)}")
    recorded = json.loads((Path(path).expanduser() / "config.json").read_text()).get("embed_tokens_sha256")
    if recorded and embedding_digest(emb) != recorded:
        raise _unfit(path, target_name, "the folder has no embed_tokens and the target's embeddings differ from the "
                                        f"ones the head was trained with (digest {embedding_digest(emb)} != "
                                        f"{recorded} recorded by the export)")
    with torch.no_grad():
        head.embed_tokens.weight.copy_(emb.detach().to(head.embed_tokens.weight))
    log(f"[draft] {path} has no embed_tokens: using the target's input embeddings ({list(want)}"
        + (", digest matches the export's record)" if recorded else ", shape checked; no digest recorded)"))


def check_eagle3_head(draft, path, target_model, target_name: str = "the target", log=print) -> None:
    """An EAGLE-3 head loaded from `path` against `target_model`: its feature width and aux layers must be the
    target's (else ValueError naming the target it was trained for); it gets the target's embeddings when the folder
    has none (fill_eagle3_embeddings)."""
    c = draft.config
    t = target_model.config.get_text_config()
    if c.target_hidden_size != t.hidden_size:
        raise _unfit(path, target_name, f"the head reads target features of width {c.target_hidden_size}, the "
                                        f"target's hidden size is {t.hidden_size}")
    if c.aux_layer_ids and max(c.aux_layer_ids) > t.num_hidden_layers:
        raise _unfit(path, target_name, f"the head reads the target's hidden states {list(c.aux_layer_ids)}, the "
                                        f"target has {t.num_hidden_layers} layers")
    fill_eagle3_embeddings(draft, path, target_model, target_name, log)


def _dflash_fits(draft, path, target_model, target_name: str, log) -> None:
    from specdistill.drafts.dflash.export import check_target  # the layers, width and vocabulary it reads

    problems = check_target(draft.config, target_model.config.get_text_config().to_dict())
    if problems:
        raise _unfit(path, target_name, "; ".join(problems))


FITS: dict[str, Callable] = {"eagle3": check_eagle3_head, "dflash": _dflash_fits}  # kind -> checks beyond check_target


def check_readable(path) -> None:
    """Refuse, by name, a folder that no draft kind reads back: a speculators-format export (vLLM serves it; the
    speculators library loads it), which would otherwise be opened as a plain causal LM and fail in transformers."""
    from specdistill.drafts.eagle3.export import SPECULATORS_ARCH

    try:
        raw = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loaders say what is missing
    if SPECULATORS_ARCH in (raw.get("architectures") or []):
        raise ValueError(f"{path} is a speculators-format export ({SPECULATORS_ARCH}), which specdistill does not "
                         "load: evaluate the checkpoint's draft/ folder it was exported from, or an export made with "
                         "--format vllm")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_draft_tokenizer(path, target_tokenizer, log=print) -> None:
    """A saved draft's own tokenizer must map every token as the target's does; a folder without one is said to skip
    the check (only the vocabulary size is compared then)."""
    from specdistill.models.draft import check_tokenizers_match

    if any((Path(path).expanduser() / f).exists() for f in TOKENIZER_FILES):
        check_tokenizers_match(str(path), target_tokenizer)
    else:
        log(f"[draft] {path} ships no tokenizer: the tokenizer check is skipped (only the vocabulary size is "
            "compared); a draft trained with another tokenizer would run on the wrong token ids")


def read_back(draft, path, target_model, target_name: str = "the target", log=print) -> None:
    """Check a draft loaded from `path` against the target it will run with, before decoding (every kind), and give
    an EAGLE-3 head its embeddings. Raises ValueError naming the folder, the problem and the target it was trained
    for."""
    from specdistill.drafts import draft_adapter

    adapter = draft_adapter(draft)
    try:
        adapter.check_target(target_model, "a draft must share the target's tokenizer and output layer size")
    except ValueError as e:
        raise _unfit(path, target_name, str(e)) from None
    extra = FITS.get(adapter.kind)  # the kind's own checks first: a wrong width or layer names the size that differs
    if extra is not None:
        extra(adapter.module, path, target_model, target_name, log)
    check_trained_target(path, target_model, target_name, log)
