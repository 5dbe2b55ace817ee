"""Drafts read back as they were trained: a saved draft is checked against the target it will run with before any
decoding.

Every kind: its adapter's check_target (the vocabulary it scores) must pass, then the kind's own checks (its spec's
`fits`: an EAGLE-3 head's width, aux layers and embeddings, drafts/eagle3/readback.py); a failure names the folder and
the target it was trained for (an export's `specdistill_target`, or the checkpoint's config.yaml). A draft whose
checkpoint (inputs.json) or own config.json records the digest of its target's input embeddings runs only with a
target of the same embeddings (check_trained_target). Knows no kind by name, nor the evaluator or training.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


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
        raise unfit(path, target_name, f"the target's input embeddings differ from those of the target it was "
                                       f"trained with (digest {now} != {recorded} recorded in {where})")


def unfit(path, target_name: str, problem: str) -> ValueError:
    was = trained_for(path)
    origin = f"it was trained for {was}" if was else "its folder does not record the target it was trained for"
    return ValueError(f"the draft at {path} does not fit the target {target_name}: {problem}; {origin}. Fix: evaluate "
                      "it with the target it was trained for (target.path=...), or train a draft for this target")


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
    """Check a draft loaded from `path` against the target it will run with, before decoding: its kind's checks
    (drafts/registry.py: DraftKind.check_against_target), then the target it was trained for (its embeddings'
    digest). Raises ValueError naming the folder, the problem and the target it was trained for."""
    from specdistill.drafts.registry import draft_adapter

    draft_adapter(draft).spec.check_against_target(draft, path, target_model, target_name, log)
    check_trained_target(path, target_model, target_name, log)
