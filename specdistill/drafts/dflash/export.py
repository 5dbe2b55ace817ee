"""DFlash drafts -> the folder vLLM's DFlash model loads (speculative method "dflash"), validated tensor by tensor.

The training checkpoint already uses vLLM's tensor names and config keys (model.py's docstring); the export drops the
frozen copies of the target's embedding and LM head (vLLM shares the target's when a draft ships none), drops our own
config fields, optionally casts, and re-reads what it wrote: every expected tensor present with its shape, nothing
else. Refused, with the reason: a draft vLLM would run differently (a scaled embedding, a soft-capped readout), or one
built for another target (layer count, width or vocabulary differ from --target's).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from specdistill.export import WEIGHTS_FILE, ExportResult, check_d2t, check_target_sizes, write_weights

from .model import DFlashConfig

FORMATS = ("vllm",)
SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, frozen: vLLM uses the target's own
OWN_FIELDS = ("embed_scale", "final_logit_softcapping")  # specdistill's config fields, not vLLM's


def expected_tensors(c: DFlashConfig, include_embeddings: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the vLLM layout with its shape."""
    H, hd, I = c.hidden_size, c.head_dim, c.intermediate_size
    out = {"fc.weight": (H, len(c.target_layer_ids) * c.target_hidden_size), "hidden_norm.weight": (H,),
           "norm.weight": (H,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (c.num_attention_heads * hd, H),
                    p + "self_attn.k_proj.weight": (c.num_key_value_heads * hd, H),
                    p + "self_attn.v_proj.weight": (c.num_key_value_heads * hd, H),
                    p + "self_attn.o_proj.weight": (H, c.num_attention_heads * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I),
                    p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
    if c.draft_vocab_size < c.vocab_size:  # a reduced vocabulary: its own LM head rows and the id map
        out.update({"lm_head.weight": (c.draft_vocab_size, H), "d2t": (c.draft_vocab_size,)})
    if include_embeddings:
        out.update({"embed_tokens.weight": (c.vocab_size, H), "lm_head.weight": (c.draft_vocab_size, H)})
    return out


def check_tensors(c: DFlashConfig, sd: dict[str, torch.Tensor], include_embeddings: bool = False) -> list[str]:
    """Problems of a state dict against the layout: missing, unexpected, wrong shape, non-finite."""
    want = expected_tensors(c, include_embeddings)
    errs = [f"missing tensor {k} {list(s)}" for k, s in want.items() if k not in sd]
    errs += [f"unexpected tensor {k}" for k in sd if k not in want]
    for k, s in want.items():
        if k in sd:
            if tuple(sd[k].shape) != s:
                errs.append(f"tensor {k} has shape {list(sd[k].shape)}, expected {list(s)}")
            elif not bool(torch.isfinite(sd[k].float()).all()):
                errs.append(f"tensor {k} has non-finite values")
    if "d2t" in sd and tuple(sd["d2t"].shape) == want.get("d2t"):
        errs += check_d2t(sd["d2t"], c.vocab_size, "rebuild with DFlashDraft.set_vocab(sorted unique target ids)")
    return errs


def check_target(c: DFlashConfig, target: dict) -> list[str]:
    """The draft against the target's config.json (its text config)."""
    errs = []
    if target.get("num_hidden_layers") != c.num_target_layers:
        errs.append(f"the draft reads layers {c.target_layer_ids} of a {c.num_target_layers}-layer target, but the "
                    f"target has {target.get('num_hidden_layers')} layers")
    return errs + check_target_sizes(target, c.target_hidden_size, c.vocab_size, "draft")


def vllm_config(c: DFlashConfig) -> dict:
    d = c.to_hf_dict()
    for k in OWN_FIELDS:
        d.pop(k, None)
    return d


def export_dflash(draft_dir, out_dir, fmt: str = "vllm", target_path: Optional[str] = None, overwrite: bool = False,
                  dtype: Optional[str] = None, include_embeddings: bool = False, **_eagle3_options):
    """Write the checkpoint's draft folder as vLLM's DFlash layout in out_dir; returns specdistill.export.ExportResult.
    EAGLE-3-only options (speculative_tokens, verifier_name) do not apply: vLLM drafts block_size - 1 tokens."""
    from safetensors.torch import load_file

    from specdistill.export import read_target_config

    if fmt not in FORMATS:
        raise ValueError(f"a DFlash draft exports to {FORMATS} only (SGLang and speculators have no DFlash layout "
                         f"here), got format {fmt!r}")
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists: pass overwrite=True (--overwrite) or another folder")
    c = DFlashConfig.from_hf_dict(json.loads((draft_dir / "config.json").read_text()))
    errs = []
    if c.embed_scale != 1.0:
        errs.append(f"the target scales its embeddings by {c.embed_scale:g}; vLLM's DFlash model embeds the block "
                    "with the plain embedding table, so it would serve another draft")
    if c.final_logit_softcapping:
        errs.append("the target soft-caps its logits; vLLM's DFlash readout does not, so it would serve another draft")
    if target_path is not None:
        _, target = read_target_config(target_path)
        errs += check_target(c, target)
    sd = load_file(str(draft_dir / WEIGHTS_FILE))
    sd.pop("t2d", None)  # ours only (vLLM skips it)
    if c.draft_vocab_size == c.vocab_size:
        sd.pop("d2t", None)  # all zeros: vLLM reads the full vocabulary without a map
    if not include_embeddings:
        keep = ("lm_head.weight",) if c.draft_vocab_size < c.vocab_size else ()
        sd = {k: v for k, v in sd.items() if k not in SHARED or k in keep}
    if dtype is not None:
        to = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        sd = {k: v.to(to) if v.is_floating_point() else v for k, v in sd.items()}  # d2t stays int64
    errs += check_tensors(c, sd, include_embeddings)
    if errs:
        raise ValueError(f"cannot export {draft_dir} for vLLM:\n  - " + "\n  - ".join(errs))
    config = vllm_config(c)
    if dtype is not None:
        config["torch_dtype"] = dtype
    warnings = []
    if c.sliding_window is not None:
        warnings.append(f"sliding window {c.sliding_window}: here a block sees the {c.sliding_window} context "
                        "positions before its anchor; an engine that windows per query position shifts that edge by "
                        f"up to {c.block_size - 1} positions for the later block positions (compare acceptance once "
                        "served)")
    _write_atomic(out_dir, config, sd, include_embeddings)
    tensors = {k: (list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in sd.items()}
    return ExportResult(out_dir, fmt, tensors, warnings, config)


def validate_dflash_export(path, include_embeddings: bool = False) -> DFlashConfig:
    """Re-read an export: the config parses (settings checked by name) and every tensor matches the layout."""
    from safetensors.torch import load_file

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    if raw.get("architectures") != ["DFlashDraftModel"]:
        raise ValueError(f"{path}: architectures {raw.get('architectures')} is not ['DFlashDraftModel']")
    c = DFlashConfig.from_hf_dict(raw)
    errs = check_tensors(c, load_file(str(path / WEIGHTS_FILE)), include_embeddings)
    if errs:
        raise ValueError(f"{path} is not a valid DFlash export:\n  - " + "\n  - ".join(errs))
    return c


def validate_export(path, target_path: Optional[str] = None) -> ExportResult:
    """An export re-read as --check reads it: validate_dflash_export (with the embeddings when the export ships
    them), and the draft against --target's config when given. Raises ValueError listing every problem."""
    from safetensors.torch import load_file

    from specdistill.export import read_target_config

    path = Path(path)
    sd = load_file(str(path / WEIGHTS_FILE))
    c = validate_dflash_export(path, include_embeddings="embed_tokens.weight" in sd)
    if target_path is not None:
        errs = check_target(c, read_target_config(target_path)[1])
        if errs:
            raise ValueError(f"{path} does not fit the target {target_path}:\n  - " + "\n  - ".join(errs))
    tensors = {k: (list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in sd.items()}
    return ExportResult(path, "vllm", tensors, [], json.loads((path / "config.json").read_text()))


def _write_atomic(out_dir: Path, config: dict, tensors: dict, include_embeddings: bool) -> None:
    from specdistill.files import replace_folder

    with replace_folder(out_dir) as tmp:
        write_weights(tmp, tensors, config)
        validate_dflash_export(tmp, include_embeddings)  # what vLLM will read, re-read from disk
