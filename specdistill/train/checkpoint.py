"""Atomic checkpoints that resume exactly: a step folder is written under a temp name and renamed when complete.

Layout of <output_dir>/checkpoints/step-0000100/:
  draft/              the draft in HF format (safetensors, config.json, tokenizer)
  state/              accelerate.save_state: model, optimizer, scheduler, RNG of every rank; objective_<rank>.pt:
                      the objective's own state on every rank when it has one (Draft-OPD: replay buffer, cached
                      rollout, rollout RNG), so an on-policy run resumes exactly
  trainer_state.json  step, epoch, tokens seen
  metrics.json        the latest metrics (training and held-out acceptance)
  config.yaml         the fully resolved config of the run; a resume compares its own with it (check_resume_config):
                      it lists the keys that differ and refuses those that break exactness (shapes, data order)
  inputs.json         what it was trained on, by content (train/inputs.py): the data's bytes, the target's files and
                      input embeddings, the tokenizer and its chat template; a resume over changed inputs is refused,
                      and evaluation refuses the draft with a target of other embeddings (drafts/readback.py)
  manifest.json       size and SHA-256 of every file above (resume verifies them; a corrupt step-N is renamed
                      step-N.corrupt and the previous one is used)
A folder whose name starts with "." is incomplete (a crash mid-save: .step-N.tmp) or being deleted (.step-N.del) and is
never resumed from; debris of either kind is removed by the next save.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from specdistill.files import WriteFailed, follow_umask, named_writes, write_manifest

STEP_RE = re.compile(r"^step-(\d+)$")

# Config keys (a prefix ending in "." covers everything under it) whose change on resume breaks exactness: the model
# shapes (the saved weights and optimizer state would not fit, or fit another model), the data order (step s would
# read other examples) or the objective (its loss, and an on-policy objective's saved rollout state). Resuming with a
# change here is refused, unless trainer.resume_allow_drift=true.
EXACTNESS_KEYS = ("target.path", "target.aux_layer_ids", "draft.", "data.", "objective.", "warmup.", "trainer.seed",
                  "trainer.micro_batch_size", "trainer.grad_accum")
# Under those prefixes, keys that change neither: a warm-start path (the weights come from the checkpoint), where
# prepared data is cached and how many workers prepare it, the malformed-rows threshold.
HARMLESS_KEYS = ("draft.path", "data.cache_dir", "data.num_proc", "data.max_malformed_fraction",
                 "data.regenerate.store_dir")
# differ by design between a run and its resume
SILENT_KEYS = ("trainer.resume", "trainer.resume_allow_drift", "trainer.resume_accept_changed_inputs")


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.exists():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))
             and (p / "trainer_state.json").exists()]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: Optional[str], output_dir: str | Path) -> Optional[Path]:
    if not resume:
        return None
    if resume == "auto":
        ckpts = list_checkpoints(output_dir)
        return ckpts[-1] if ckpts else None
    p = Path(resume).expanduser()
    if not (p / "trainer_state.json").exists() or not (p / "state").exists():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint folder (needs "
                                "trainer_state.json and state/); use trainer.resume=auto to take the newest one")
    return p


@dataclass
class ConfigDrift:
    """How a resumed run's config differs from its checkpoint's config.yaml: {dotted key: (checkpoint, now)}."""
    changed: dict[str, tuple[Any, Any]]

    @property
    def breaking(self) -> list[str]:
        """The changed keys that break an exact resume (model shapes, data order)."""
        return [k for k in self.changed if _matches(k, EXACTNESS_KEYS) and not _matches(k, HARMLESS_KEYS)]


def config_drift(checkpoint_yaml: str, run_yaml: str) -> ConfigDrift:
    """Compare two resolved config YAMLs (a checkpoint's config.yaml and the resumed run's), key by key."""
    import yaml

    old = _flatten(yaml.safe_load(checkpoint_yaml) or {})
    new = _flatten(yaml.safe_load(run_yaml) or {})
    missing = "<absent>"
    changed = {k: (old.get(k, missing), new.get(k, missing)) for k in sorted(old.keys() | new.keys())
               if old.get(k, missing) != new.get(k, missing) and not _matches(k, SILENT_KEYS)}
    return ConfigDrift(changed)


def check_resume_config(checkpoint: Path, run_yaml: str, allow_drift: bool = False,
                        log: Callable[[str], None] = print) -> ConfigDrift:
    """Say which config keys differ from the checkpoint's config.yaml; refuse (ValueError naming the keys and the fix)
    where a difference breaks exactness, unless allow_drift."""
    f = Path(checkpoint) / "config.yaml"
    if not f.exists():
        log(f"[train] warning: {f} is missing: the run's config cannot be compared with the checkpoint's")
        return ConfigDrift({})
    drift = config_drift(f.read_text(), run_yaml)
    if drift.changed:
        log(f"[train] resume: the config differs from {f} in {len(drift.changed)} key(s) (checkpoint -> now): "
            + ", ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, (a, b) in drift.changed.items()))
    breaking = drift.breaking
    if breaking and not allow_drift:
        back = " ".join(_override(k, drift.changed[k][0]) for k in breaking)
        raise ValueError(
            f"trainer.resume={checkpoint}: {', '.join(breaking)} differ from the checkpoint's config.yaml, which "
            f"breaks an exact resume (model shapes or data order). Fix: resume with the checkpoint's values ({back}), "
            "or start a fresh run in another trainer.output_dir warm-started with "
            f"draft.path={Path(checkpoint) / 'draft'} (and draft=pretrained for an LM draft), or pass "
            "trainer.resume_allow_drift=true to continue anyway (the result then differs from an uninterrupted run)")
    if breaking:
        log(f"[train] warning: trainer.resume_allow_drift=true: {', '.join(breaking)} changed, so this resume is not "
            "exact")
    return drift


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key.startswith(p) if p.endswith(".") else key == p or key.startswith(p + ".") for p in patterns)


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _override(key: str, value: Any) -> str:
    """key=value as a Hydra command-line override."""
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, (list, dict)):
        return f"{key}={json.dumps(value).replace(' ', '')}"
    return f"{key}={value}"


def save_checkpoint(accelerator, draft, tokenizer, output_dir, step: int, trainer_state: dict, metrics: dict,
                    config_yaml: str, keep: int = 2, objective=None, target=None) -> Path:
    """Every rank must call this (accelerate gathers state); only the main process writes shared files.
    `target`: the run's target, whose input embeddings' digest inputs.json records (with what else the run's config
    names: train/inputs.py).
    `objective`: its state_dict() saved per rank when not empty (not accelerate's register_for_checkpointing, which
    keeps rank 0's copy only; on-policy state such as a replay buffer differs per rank).
    A write that fails for space or permission raises files.WriteFailed naming the folder, trainer.output_dir and
    the newest complete checkpoint, which is kept; the partial folder is removed."""
    root = checkpoint_dir(output_dir)
    earlier = list_checkpoints(output_dir)
    kept = (f"The previous checkpoint {earlier[-1]} is complete and kept (resume from it with trainer.resume=auto)"
            if earlier else "No earlier checkpoint exists")
    try:
        with named_writes(root, "trainer.output_dir", kept):
            return _save(accelerator, draft, tokenizer, output_dir, step, trainer_state, metrics, config_yaml, keep,
                         objective, target)
    except WriteFailed:
        if accelerator.is_main_process:
            shutil.rmtree(root / f".step-{step:07d}.tmp", ignore_errors=True)  # give the space back
        raise


def _save(accelerator, draft, tokenizer, output_dir, step: int, trainer_state: dict, metrics: dict,
          config_yaml: str, keep: int, objective, target=None) -> Path:
    from specdistill.train.inputs import inputs_from_yaml, target_embedding_digest, write_inputs

    root = checkpoint_dir(output_dir)
    final = root / f"step-{step:07d}"
    tmp = root / f".step-{step:07d}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for debris in [*root.glob(".step-*.tmp"), *root.glob(".step-*.del")]:
            shutil.rmtree(debris, ignore_errors=True)  # left by a process killed mid-save or mid-delete
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"))
    objective_state = objective.state_dict() if objective is not None else {}
    if objective_state:  # objectives/base.py: stateless objectives return {}
        import torch

        (tmp / "state").mkdir(parents=True, exist_ok=True)
        torch.save(objective_state, tmp / "state" / f"objective_{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()  # every rank's files are in place before the main process renames
    state_dict = accelerator.get_state_dict(draft)  # full state dict (gathered under FSDP/ZeRO-3)
    # every process: a sharded target's embeddings are gathered collectively
    embeddings = target_embedding_digest(target) if target is not None else None
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(draft)
        unwrapped.save_pretrained(tmp / "draft", state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "draft")
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
        inputs = inputs_from_yaml(config_yaml, tokenizer, embeddings)
        write_inputs(tmp, inputs)
        _record_target(tmp / "draft", inputs.get("target_path"), embeddings)
        # trainer_state.json is written last: its presence marks the content complete, the rename makes it visible.
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        write_manifest(tmp)  # sizes + SHA-256 of every file: resume verifies them (train/integrity.py)
        follow_umask(tmp)
        _fsync_dir(tmp)
        if final.exists():  # a re-save of this step: move the old copy aside first (a kill here keeps it whole)
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
            _discard(old)
    accelerator.wait_for_everyone()
    return final


def _record_target(draft_dir: Path, target_path: Optional[str], embeddings: Optional[str]) -> None:
    """The draft folder's config.json names the target it was trained for (`specdistill_target`) and the digest of
    that target's input embeddings (`embed_tokens_sha256`), the keys an EAGLE-3 export records: a draft folder copied
    out of its checkpoint is still checked against its target (drafts/readback.py)."""
    cfg_file = draft_dir / "config.json"
    if not cfg_file.exists():
        return
    config = json.loads(cfg_file.read_text())
    if target_path is not None:  # a run's config names it; a bare save (tests, tools) may not
        config["specdistill_target"] = target_path
    if embeddings is not None:
        config["embed_tokens_sha256"] = embeddings
    cfg_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_checkpoint(accelerator, path: Path, objective=None) -> dict:
    """Restore model, optimizer, scheduler and RNG (and the objective's own state) in place; return the trainer
    state (step, epoch...)."""
    accelerator.load_state(str(path / "state"))
    if objective is not None and objective.state_dict():  # a stateful objective (objectives/base.py protocol)
        import torch

        f = path / "state" / f"objective_{accelerator.process_index}.pt"
        if f.exists():
            objective.load_state_dict(torch.load(f, map_location="cpu", weights_only=False))
        else:
            print(f"[train] warning: {f} is missing (a checkpoint from another objective or number of processes): "
                  f"the objective {type(objective).__name__} starts with fresh state, so this resume is not exact")
    return json.loads((path / "trainer_state.json").read_text())


def _discard(path: Path) -> None:
    """Delete a checkpoint so that no kill -9 leaves a half-deleted folder under a step-N name: rename to a dot-name
    (never listed, never resumed from) first, then delete."""
    trash = path.with_name(f".{path.name}.del")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
