"""Export plumbing every draft kind shares: the result an export returns, the target's config as a serving engine
reads it, the digest that ties an export to its target's embeddings, the weights-and-config folder every draft and
export is written as, and the checks of a reduced vocabulary's d2t. Each kind's formats, layout and validation live
with the kind (drafts/<kind>/export.py, named by its spec's exporters)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


@dataclass
class ExportResult:
    """What an export wrote (or a validation read): the folder, its format, its tensors and config, the warnings."""
    out_dir: Path
    format: str  # one of its kind's formats (drafts/registry.py: DraftKind.exporters)
    tensors: dict[str, tuple[list[int], str]]  # name in the written file -> (shape, dtype)
    warnings: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # the written config.json

    def summary(self) -> str:
        """A plain-text table: the tensors with shape and dtype, then key config fields and warnings."""
        w = max(len(n) for n in self.tensors) if self.tensors else 10
        lines = [f"{self.format} export -> {self.out_dir}", f"{'tensor':<{w}}  {'shape':<16} dtype", "-" * (w + 30)]
        for name, (shape, dtype) in sorted(self.tensors.items()):
            lines.append(f"{name:<{w}}  {str(shape):<16} {dtype}")
        c = flat_fields(self.config)
        lines.append("-" * (w + 30))
        for key in ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "max_position_embeddings",
                    "rope_theta", "rope_scaling", "eagle_aux_hidden_state_layer_ids", "norm_before_residual"):
            lines.append(f"{key:<{w}}  {c.get(key)}")
        if self.format == "speculators":
            sc = self.config.get("speculators_config", {})
            k = sc.get("proposal_methods", [{}])[0].get("speculative_tokens")
            lines.append(f"{'speculative_tokens':<{w}}  {k}")
            lines.append(f"{'verifier':<{w}}  {sc.get('verifier', {}).get('name_or_path')}")
        lines += [f"warning: {m}" for m in self.warnings]
        return "\n".join(lines)


def write_weights(folder, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """WEIGHTS_FILE and config.json into `folder` (which must exist): each tensor as a fresh contiguous CPU copy
    (safetensors refuses tensors that share storage), the config as indented JSON."""
    from safetensors.torch import save_file

    folder = Path(folder)
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()},
              str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def check_target_sizes(target: dict, hidden_size: int, vocab_size: int, draft: str) -> list[str]:
    """The target's config.json (its text config) against the width a draft reads (the target hidden size its fc
    takes) and the vocabulary it scores; `draft` names the draft in the sentences ("head", "draft")."""
    errs = []
    if target.get("hidden_size") != hidden_size:
        errs.append(f"target hidden_size {target.get('hidden_size')} != the {draft}'s target_hidden_size "
                    f"{hidden_size}: this {draft} was trained for another target")
    if target.get("vocab_size") != vocab_size:
        errs.append(f"target vocab_size {target.get('vocab_size')} != the {draft}'s vocab_size {vocab_size}: this "
                    f"{draft} was trained for another tokenizer")
    return errs


def check_d2t(d2t: torch.Tensor, vocab_size: int, fix: str) -> list[str]:
    """Problems of a reduced vocabulary's d2t (Vd,): int64 offsets (target id = draft id + d2t[draft id], as vLLM
    reads them) that give strictly increasing target ids inside [0, vocab_size). `fix` ends each sentence."""
    if d2t.dtype != torch.int64:
        return [f"d2t has dtype {d2t.dtype}, expected int64 offsets: {fix}"]
    target_ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t.cpu()
    out = ((target_ids < 0) | (target_ids >= vocab_size)).nonzero().flatten()
    if len(out):
        return [f"d2t maps draft ids {out[:5].tolist()} outside the target vocab [0, {vocab_size}): d2t holds offsets "
                f"(target = draft + d2t[draft]); {fix}"]
    if d2t.numel() > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        return [f"d2t target ids are not strictly increasing (duplicates or an unsorted draft vocabulary): {fix}"]
    return []


def flat_fields(raw: dict) -> dict:
    """The flat view of a config.json (a speculators-format config nests the layer's fields under
    transformer_layer_config and keeps the draft's own fields at the top)."""
    if "transformer_layer_config" not in raw:
        return raw
    flat = dict(raw["transformer_layer_config"])
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual"):
        if key in raw:
            flat[key] = raw[key]
    return flat


def read_target_config(target_path: str) -> tuple[str, dict]:
    """(resolved path, config dict) of the target; `embedded:` names resolve (and convert once) via assets."""
    from specdistill.assets import resolve_model_path

    resolved = resolve_model_path(str(target_path))
    p = Path(resolved).expanduser()
    cfg_file = p if p.name == "config.json" else p / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"target config {cfg_file} not found: pass a local HF folder or "
                                "embedded:smollm2-135m-instruct")
    d = json.loads(cfg_file.read_text())
    d = d.get("text_config") or d  # multimodal wrappers keep the LM under text_config
    return str(cfg_file.parent), d


def embedding_digest(weight: torch.Tensor) -> str:
    """SHA-256 (first 16 hex digits) of embeddings (V, H) rounded to bfloat16: the same for a target loaded in
    float32 or bfloat16, so an export records which target's embeddings its head was trained with."""
    bits = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    return hashlib.sha256(bits.numpy().tobytes()).hexdigest()[:16]
