"""Export a trained EAGLE-3 head for serving engines, validating every tensor before anything is written.

Three formats (names and conventions as vLLM, SGLang and speculators load them):
  vllm         the "midlayer" format: a flat Llama config.json with architectures ["LlamaForCausalLMEagle3"] +
               model.safetensors named as in model.py.
  sglang       the same files, with the aux layer ids written in SGLang's convention (each id minus one, see below)
               and `aux_layer_convention: "sglang"` so specdistill reads them back correctly.
  speculators  vllm-project/speculators: architectures ["Eagle3Speculator"], a nested `transformer_layer_config`,
               `speculators_config` (proposal method, verifier), weights under `layers.0.` instead of `midlayer.`.

Why validate ourselves: vLLM silently serves a draft with a missing `down_proj`, `d2t` or `lm_head` (it just accepts
nothing). So every expected tensor is checked by name, shape and dtype against the config, the vocabulary maps are
checked for consistency, aux layer ids are checked against the target's depth, and unknown tensors are refused. Any
problem raises one ValueError listing each bad tensor and its fix; the export is written to a temporary folder,
re-read and re-validated, then renamed into place, so a failed export leaves nothing behind.

Aux layer convention (vLLM 0.32, checked in its llama.py): id k = the residual stream after k target decoder layers
(hidden + residual; 0 = the embeddings) = HF output_hidden_states[k] for k < L. vLLM sorts and de-duplicates the ids and
concatenates the features in layer order, so fc's column blocks must follow ascending ids (unsorted ids are fixed here
by permuting fc). Exported ids must satisfy 0 <= k < L: vLLM's k = L is the PRE-final-norm stream, while HF's
hidden_states[L] (what training read) is post-final-norm, so a head trained on k = L would be served other features.
SGLang (checked in its llama.py: `layers_to_capture = [val + 1 for val in layer_ids]`, a layer capturing the stream
entering it) serves config id j with the stream after j + 1 layers, so the same head needs ids k - 1 there; a vllm
export loaded in SGLang runs but is fed the wrong layers (silently lower acceptance). k = 0 (the embeddings) has no
SGLang id.

Architectures (tests/test_architectures_train.py runs llama, qwen2, qwen3, gemma3, mistral, mixtral, qwen3_moe):
- Embedding scale (Gemma: the embedding module multiplies rows by sqrt(hidden)). vLLM shares the target's embedding
  MODULE with a head that ships no embed_tokens, and vLLM's Gemma-3 applies the normaliser outside that module, so a
  head would be served unscaled embeddings; vLLM keeps a head's own embed_tokens when they differ from the target's
  (eagle.py: has_own_embed_tokens), so vllm / speculators exports of a scaled head write embed_tokens.weight with the
  scale folded in (exact). SGLang always replaces a head's embeddings with the target's weight (set_embed), so there
  the scale is lost; the head's input_layernorm makes that an eps change only (rms(s*e) vs rms(e)), measured on the
  head's embeddings and refused when it is not negligible.
- Soft-capped final logits (Gemma): the target's are capped by the engine as in HF; a head's never are (vLLM's
  Eagle3LlamaForCausalLM has no cap), as in training.
- Targets the engine does not accept for EAGLE-3: vLLM checks the target's model_type against a list
  (config/speculative.py `eagle3_target_supported`: llama, qwen, minicpm, gpt_oss, ... substring match); the export
  says so for others (mistral, mixtral, gemma3) rather than pretend it serves.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from specdistill.export import (ExportResult, check_d2t, check_target_sizes, embedding_digest, flat_fields,
                                read_target_config, write_weights)

from .model import Eagle3Config, Eagle3Head, single_rope

FORMATS = ("vllm", "sglang", "speculators")  # the serving formats an EAGLE-3 head is written in
MIDLAYER_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
# Tensors whose names differ between formats: midlayer `midlayer.X` <-> speculators `layers.0.X`; the rest are equal.
_MID, _SPEC = "midlayer.", "layers.0."
# model_type substrings vLLM accepts as EAGLE-3 targets (config/speculative.py, eagle3_target_supported, 2025-26)
VLLM_EAGLE3_TARGETS = ("llama", "qwen", "minicpm", "gpt_oss")
# SGLang serves a scaled head with the target's unscaled embeddings: allowed while the input_layernorm output of
# 99% of the vocabulary rows moves by less than this (relative)
SGLANG_EMBED_SCALE_TOLERANCE = 1e-3


# ---------------------------------------------------------------------------------------------------- expectations
def expected_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Midlayer name -> (shape, dtype kind: 'float' | 'int64' | 'bool') computed from the config alone.
    embed_tokens.weight is optional (engines reuse the target's) and listed separately by `optional_tensors`."""
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    V, Vd, n_aux = cfg.vocab_size, cfg.draft_vocab_size, len(cfg.aux_layer_ids)
    f = "float"
    return {
        "fc.weight": ((H, n_aux * Ht), f),
        "midlayer.input_layernorm.weight": ((H,), f),
        "midlayer.hidden_norm.weight": ((H,), f),
        "midlayer.post_attention_layernorm.weight": ((H,), f),
        "midlayer.self_attn.q_proj.weight": ((nh * hd, 2 * H), f),  # input = concat(norm(embed), norm(hidden))
        "midlayer.self_attn.k_proj.weight": ((nkv * hd, 2 * H), f),
        "midlayer.self_attn.v_proj.weight": ((nkv * hd, 2 * H), f),
        "midlayer.self_attn.o_proj.weight": ((H, nh * hd), f),
        "midlayer.mlp.gate_proj.weight": ((I, H), f),
        "midlayer.mlp.up_proj.weight": ((I, H), f),
        "midlayer.mlp.down_proj.weight": ((H, I), f),
        "norm.weight": ((H,), f),
        "lm_head.weight": ((Vd, H), f),
        **({} if Vd == V else vocab_maps(cfg)),
    }


def vocab_maps(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """The draft-to-target maps of a reduced vocabulary. A full-vocabulary head may leave them out, and its vLLM export
    does: vLLM 0.32 builds no draft_id_to_target_id for a draft vocabulary equal to the target's and refuses a d2t."""
    return {"d2t": ((cfg.draft_vocab_size,), "int64"),  # offsets: target_id = draft_id + d2t[draft_id]
            "t2d": ((cfg.vocab_size,), "bool")}


def optional_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    return {"embed_tokens.weight": ((cfg.vocab_size, cfg.hidden_size), "float"),
            **(vocab_maps(cfg) if full_vocab else {})}


def _kind_ok(t: torch.Tensor, kind: str) -> bool:
    return {"float": t.is_floating_point(), "int64": t.dtype == torch.int64, "bool": t.dtype == torch.bool}[kind]


def _fix_hint(name: str) -> str:
    if name == "d2t" or name == "t2d":
        return "rebuild the vocab maps with Eagle3Head.set_vocab(draft_to_target_ids) and re-save the head"
    if name == "embed_tokens.weight":
        return "copy the target's input embeddings into the head (build_eagle3 does) or export without embeddings"
    return "re-save the head from the trained model (Eagle3Head.save_pretrained) or fix the config sizes"


def check_config(cfg: Eagle3Config, raw: dict) -> list[str]:
    """Config-level problems (each a sentence with the fix). raw: the flat (midlayer-style) config dict."""
    errs = []
    if raw.get("num_hidden_layers", 1) != 1:
        errs.append(f"num_hidden_layers={raw.get('num_hidden_layers')}: EAGLE-3 heads here have exactly 1 layer")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        errs.append(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of num_key_value_heads="
                    f"{cfg.num_key_value_heads}")
    if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
        errs.append(f"draft_vocab_size={cfg.draft_vocab_size} must be in [1, vocab_size={cfg.vocab_size}]")
    aux = cfg.aux_layer_ids
    if len(aux) != 3 or len(set(aux)) != 3 or min(aux, default=0) < 0:
        errs.append(f"eagle_aux_hidden_state_layer_ids={aux}: need 3 distinct ids >= 0 (vLLM convention: k = "
                    "hidden_states[k])")
    if cfg.hidden_act != "silu":
        errs.append(f"hidden_act={cfg.hidden_act!r}: the engines' EAGLE-3 Llama layer uses silu")
    if raw.get("norm_before_residual") is not False:
        errs.append(f"norm_before_residual={raw.get('norm_before_residual')}: must be written explicitly as false "
                    "(our head's residual is the un-normed feature; vLLM defaults it true for the speculators format)")
    return errs


def check_tensors(cfg: Eagle3Config, sd: dict[str, torch.Tensor], target_layers: Optional[int] = None,
                  require_embeddings: bool = False) -> list[str]:
    """Every problem with a midlayer-named state dict, one sentence each (empty = valid)."""
    errs = []
    want = expected_tensors(cfg)
    opt = optional_tensors(cfg)
    for name, (shape, kind) in {**want, **opt}.items():
        t = sd.get(name)
        if t is None:
            if name in want or require_embeddings:
                errs.append(f"missing tensor {name} (expected {kind} {list(shape)}): {_fix_hint(name)}")
            continue
        if tuple(t.shape) != shape:
            errs.append(f"tensor {name} has shape {list(t.shape)}, expected {list(shape)} from the config: "
                        f"{_fix_hint(name)}")
        elif not _kind_ok(t, kind):
            errs.append(f"tensor {name} has dtype {t.dtype}, expected {kind}: {_fix_hint(name)}")
        elif kind == "float" and not bool(torch.isfinite(t).all()):
            errs.append(f"tensor {name} has NaN/Inf values: the training diverged; export an earlier checkpoint")
    for name in sorted(set(sd) - set(want) - set(opt)):
        errs.append(f"unknown tensor {name} {list(sd[name].shape)}: not part of an EAGLE-3 head; remove it (engines "
                    "would ignore or reject it)")
    d2t, t2d = sd.get("d2t"), sd.get("t2d")
    if d2t is not None and t2d is not None and not any(e.startswith(("tensor d2t", "tensor t2d")) for e in errs):
        errs += check_vocab_maps(d2t, t2d)
    if target_layers is not None:
        bad = [k for k in cfg.aux_layer_ids if not 0 <= k < target_layers]
        if bad:
            errs.append(f"eagle_aux_hidden_state_layer_ids {bad} out of range for a target with {target_layers} "
                        f"layers: use ids in [0, {target_layers - 1}] (k = residual stream after k layers; HF's "
                        f"hidden_states[{target_layers}] is post-final-norm but vLLM's id {target_layers} is pre-norm, "
                        "so a head trained on it is served different features); retrain with target.aux_layer_ids "
                        "inside that range")
    return errs


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """d2t offsets give strictly increasing target ids inside [0, V) (export.check_d2t), and exactly those ids are
    set in t2d."""
    V = t2d.numel()
    errs = check_d2t(d2t, V, "rebuild with Eagle3Head.set_vocab(sorted unique target ids)")
    if errs:
        return errs
    target_ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t.cpu()
    mask = torch.zeros(V, dtype=torch.bool)
    mask[target_ids] = True
    if not torch.equal(mask, t2d.bool()):
        errs.append(f"t2d does not match d2t ({int(t2d.sum())} ids set in t2d, {int(mask.sum())} implied by d2t, "
                    f"{int((mask != t2d.bool()).sum())} differ): rebuild both with Eagle3Head.set_vocab")
    return errs


def _raise(errs: list[str], what: str) -> None:
    if errs:
        raise ValueError(f"EAGLE-3 {what}:\n  - " + "\n  - ".join(errs))


# ---------------------------------------------------------------------------------------------------- reading
def _rope_fields(cfg_dict: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling or None) from an HF config dict, transformers 4 or 5 style."""
    rp = single_rope(dict(cfg_dict.get("rope_parameters") or {}))  # Gemma-3: the full-attention RoPE
    theta = float(rp.get("rope_theta", cfg_dict.get("rope_theta", 10000.0)))
    scaling = cfg_dict.get("rope_scaling")
    if rp and rp.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling or None


def detect_format(raw: dict) -> str:
    archs = raw.get("architectures") or []
    if SPECULATORS_ARCH in archs or raw.get("speculators_model_type") == "eagle3":
        return "speculators"
    if MIDLAYER_ARCH in archs:
        return "sglang" if raw.get("aux_layer_convention") == "sglang" else "vllm"
    raise ValueError(f"not an EAGLE-3 checkpoint: architectures={archs} (expected {MIDLAYER_ARCH} or "
                     f"{SPECULATORS_ARCH})")


@dataclass
class Checkpoint:
    format: str  # "vllm" (midlayer) | "sglang" | "speculators"
    raw: dict  # config.json as stored
    config: Eagle3Config
    state_dict: dict[str, torch.Tensor]  # midlayer names, whatever the stored format
    stored_names: list[str]  # tensor names as stored in the files


def read_checkpoint(path) -> Checkpoint:
    """An EAGLE-3 folder in either format, tensors as stored (no model is built), so a broken checkpoint can be
    diagnosed rather than crash."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}/config.json not found: pass the draft folder of a checkpoint "
                                "(e.g. outputs/eagle3/checkpoints/step-N/draft)")
    raw = json.loads((path / "config.json").read_text())
    fmt = detect_format(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    flat = flat_fields(raw)
    cfg = Eagle3Config.from_hf_dict(flat)
    cfg.rope_theta, cfg.rope_scaling = _rope_fields(flat)
    stored = sorted(sd)
    if fmt == "speculators":
        sd = {(_MID + k[len(_SPEC):]) if k.startswith(_SPEC) else k: v for k, v in sd.items()}
    return Checkpoint(fmt, raw, cfg, sd, stored)


# ---------------------------------------------------------------------------------------------------- writing
def _speculators_config(cfg: Eagle3Config, mid: dict, speculative_tokens: int, verifier_name: Optional[str],
                        verifier_archs: list[str]) -> dict:
    layer = {k: mid[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                                 "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")}
    layer.update(attention_bias=False, mlp_bias=False)
    if mid.get("rope_scaling"):
        layer["rope_scaling"] = mid["rope_scaling"]
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,  # explicit: vLLM defaults it true for this format, our head is false
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": verifier_archs},
        },
        "torch_dtype": mid.get("torch_dtype", "float32"),
    }


def _sort_aux(cfg: Eagle3Config, sd: dict, warnings: list[str]) -> None:
    """Engines concatenate aux features in ascending layer order; if the head was trained with another order,
    permute fc's column blocks to match (an exact rewrite, not an approximation)."""
    aux = list(cfg.aux_layer_ids)
    order = sorted(range(len(aux)), key=lambda i: aux[i])
    if order == list(range(len(aux))) or "fc.weight" not in sd:
        return
    Ht = cfg.target_hidden_size
    if sd["fc.weight"].shape[1] != len(aux) * Ht:
        return  # the shape check reports it
    blocks = sd["fc.weight"].split(Ht, dim=1)
    sd["fc.weight"] = torch.cat([blocks[i] for i in order], dim=1).contiguous()
    cfg.aux_layer_ids = [aux[i] for i in order]
    warnings.append(f"aux layer ids {aux} reordered to {cfg.aux_layer_ids} (engines concatenate in layer order); "
                    "fc columns permuted to match")


def export_eagle3(head_dir, out_dir, fmt: str = "vllm", target_path: Optional[str] = None,
                  include_embeddings: bool = False, speculative_tokens: int = 3,
                  verifier_name: Optional[str] = None, overwrite: bool = False,
                  dtype: Optional[str] = None) -> ExportResult:
    """Validate a trained head folder and write it in `fmt` ("vllm" midlayer | "speculators") to out_dir.

    target_path (local folder or embedded:<name>): max_position_embeddings and RoPE settings are taken from it, its
    hidden size and vocab must match the head, and aux ids must be < its depth. Without it those checks are skipped
    (a warning says so). include_embeddings writes embed_tokens.weight (engines otherwise reuse the target's).
    dtype (float32 | bfloat16 | float16) casts float tensors; default keeps them. Raises ValueError listing every
    problem and writes nothing; never replaces an existing out_dir unless overwrite=True.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {FORMATS}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists: pass overwrite=True (--overwrite) or choose another --out")
    from specdistill.files import check_draft_folder

    check_draft_folder(head_dir, what="draft to export")  # a truncated head is refused by name, not by safetensors
    ck = read_checkpoint(head_dir)
    raw_in, cfg, sd = ck.raw, ck.config, ck.state_dict
    warnings: list[str] = []
    errs = check_config(cfg, flat_fields(raw_in))

    target_layers = None
    verifier_archs: list[str] = []
    if target_path is not None:
        resolved, tcfg = read_target_config(target_path)
        target_layers = tcfg.get("num_hidden_layers")
        verifier_archs = list(tcfg.get("architectures") or [])
        verifier_name = verifier_name or resolved
        errs += check_target_sizes(tcfg, cfg.target_hidden_size, cfg.vocab_size, "head")
        mpe = tcfg.get("max_position_embeddings")
        if mpe and mpe != cfg.max_position_embeddings:
            warnings.append(f"max_position_embeddings {cfg.max_position_embeddings} -> {mpe} (the target's)")
            cfg.max_position_embeddings = int(mpe)
        theta, scaling = _rope_fields(tcfg)
        if not math.isclose(theta, cfg.rope_theta, rel_tol=1e-6):
            warnings.append(f"rope_theta {cfg.rope_theta} -> {theta} (the target's); the head was trained with "
                            f"{cfg.rope_theta}, so its positions will be rotated differently when served")
        cfg.rope_theta, cfg.rope_scaling = theta, scaling
    else:
        warnings.append("no target given: max_position_embeddings and RoPE come from the head's config, aux ids are "
                        "not range-checked; pass --target to check against the model you will serve")
    if cfg.rope_scaling:
        warnings.append(f"rope_scaling {cfg.rope_scaling} will be applied by the engine; the head's training RoPE "
                        "(specdistill.models.layers.rope_cos_sin) is the default one")

    _sort_aux(cfg, sd, warnings)
    if target_path is not None and fmt != "sglang":
        mt = str(tcfg.get("model_type", ""))
        if not any(k in mt for k in VLLM_EAGLE3_TARGETS):
            warnings.append(f"target model_type {mt!r}: vLLM versions that check `eagle3_target_supported` "
                            f"({', '.join(VLLM_EAGLE3_TARGETS)}) refuse EAGLE-3 for it; the head itself is valid")
    include_embeddings = _embedding_scale(fmt, cfg, sd, include_embeddings, errs, warnings)
    digest = None
    errs += check_tensors(cfg, sd, target_layers, require_embeddings=include_embeddings)
    if fmt == "sglang" and 0 in cfg.aux_layer_ids:
        errs.append("aux layer id 0 (the embeddings) cannot be expressed in SGLang's convention (config id j = stream "
                    "after j + 1 layers); export --format vllm, or retrain with ids >= 1")
    _raise(errs, f"export of {head_dir} refused; nothing was written")

    if not include_embeddings and "embed_tokens.weight" in sd:
        digest = embedding_digest(sd.pop("embed_tokens.weight"))  # the loader checks the target's against it
        warnings.append("embed_tokens.weight not written: engines reuse the target's input embeddings "
                        "(pass include_embeddings=True / --include-embeddings to ship them)")
    if dtype is not None:
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        sd = {k: v.to(dt) if v.is_floating_point() else v for k, v in sd.items()}
    float_dtypes = {str(v.dtype).replace("torch.", "") for v in sd.values() if v.is_floating_point()}
    mid_cfg = cfg.to_hf_dict()
    mid_cfg["norm_before_residual"] = False
    if not include_embeddings and digest is not None:
        mid_cfg["embed_tokens_sha256"] = digest
    if target_path is not None:
        mid_cfg["specdistill_target"] = str(target_path)  # what the head was trained for (drafts/readback.py)
    mid_cfg["torch_dtype"] = float_dtypes.pop() if len(float_dtypes) == 1 else "float32"
    if fmt == "vllm":
        config, tensors = mid_cfg, sd
        if cfg.draft_vocab_size == cfg.vocab_size:  # vLLM refuses a d2t for a full-vocabulary head
            tensors = {k: v for k, v in sd.items() if k not in vocab_maps(cfg)}
    elif fmt == "sglang":
        ids = [k - 1 for k in cfg.aux_layer_ids]
        config = {**mid_cfg, "eagle_aux_hidden_state_layer_ids": ids, "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids}, "aux_layer_convention": "sglang"}
        tensors = sd
        warnings.append(f"aux ids written as {ids} (SGLang config convention) for features hidden_states"
                        f"{cfg.aux_layer_ids}; do not serve this folder with vLLM (use --format vllm)")
    else:
        config = _speculators_config(cfg, mid_cfg, speculative_tokens, verifier_name, verifier_archs)
        tensors = {(_SPEC + k[len(_MID):]) if k.startswith(_MID) else k: v for k, v in sd.items()}
        if verifier_name is None:
            warnings.append("speculators_config.verifier.name_or_path is null: pass --target or --verifier-name so "
                            "`vllm serve <export>` knows which target to load")

    result = ExportResult(out_dir, fmt, {k: (list(v.shape), str(v.dtype).replace("torch.", ""))
                                         for k, v in tensors.items()}, warnings, config)
    _write_atomic(out_dir, config, tensors, overwrite, target_layers)
    return result


def _embedding_scale(fmt: str, cfg: Eagle3Config, sd: dict, include_embeddings: bool, errs: list[str],
                     warnings: list[str]) -> bool:
    """Carry a head's embedding scale into `fmt` (see the module docstring); returns whether embed_tokens.weight
    must be written. Edits cfg and sd in place."""
    s = cfg.embed_scale
    if s == 1.0:
        return include_embeddings
    emb = sd.get("embed_tokens.weight")
    if emb is None:
        errs.append(f"the head embeds tokens with scale {s:g} (the target's embedding normaliser) but has no "
                    "embed_tokens.weight to carry it: re-save the head from training (it keeps the target's rows)")
        return include_embeddings
    if fmt == "sglang":  # the engine replaces the head's embeddings with the target's unscaled weight
        ms = emb.float().pow(2).mean(-1)  # (V,)
        eps = cfg.rms_norm_eps
        dev = torch.sqrt((ms + eps) / (ms + eps / s ** 2)) - 1  # relative change of input_layernorm(embed) per row
        q99 = float(torch.quantile(dev, 0.99)) if dev.numel() else 0.0
        if q99 > SGLANG_EMBED_SCALE_TOLERANCE:
            errs.append(f"SGLang feeds EAGLE-3 heads the target's unscaled embedding weight, dropping this head's "
                        f"scale {s:g}: its input_layernorm output would change by up to {q99:.2e} (99% of rows), "
                        f"more than {SGLANG_EMBED_SCALE_TOLERANCE:g}; serve it with vLLM (--format vllm) instead")
        else:
            warnings.append(f"SGLang drops the head's embedding scale {s:g} (it shares the target's weight); after the "
                            f"head's input_layernorm that changes its input by at most {float(dev.max()):.1e} (99% of "
                            f"rows: {q99:.1e})")
        return include_embeddings
    sd["embed_tokens.weight"] = (emb * torch.tensor(s, dtype=emb.dtype)).to(emb.dtype)  # as the target computes it
    cfg.embed_scale = 1.0
    warnings.append(f"embedding scale {s:g} folded into embed_tokens.weight, which is written: vLLM would otherwise "
                    "share the target's embedding module, which (Gemma) does not apply the normaliser itself")
    return True


def _write_atomic(out_dir: Path, config: dict, tensors: dict, overwrite: bool, target_layers: Optional[int]) -> None:
    from specdistill.files import replace_folder

    with replace_folder(out_dir, overwrite) as tmp:
        write_weights(tmp, tensors, config)
        validate_export(tmp, target_layers=target_layers)  # what an engine will read, re-read from disk


# ------------------------------------------------------------------------------------------- checking / loading
def validate_export(path, target_path: Optional[str] = None, target_layers: Optional[int] = None) -> ExportResult:
    """Re-read an exported (or training) folder in either format and check it as export_eagle3 does.
    Raises ValueError listing every problem; returns the folder's ExportResult otherwise."""
    ck = read_checkpoint(path)
    fmt, raw, cfg, sd = ck.format, ck.raw, ck.config, ck.state_dict
    warnings: list[str] = []
    errs = check_config(cfg, flat_fields(raw))
    if fmt == "speculators":
        sc = raw.get("speculators_config") or {}
        methods = sc.get("proposal_methods") or [{}]
        if not isinstance(methods[0].get("speculative_tokens"), int) or methods[0]["speculative_tokens"] < 1:
            errs.append("speculators_config.proposal_methods[0].speculative_tokens must be a positive int")
        if "verifier" not in sc:
            errs.append("speculators_config.verifier is missing")
        bad = [k for k in ck.stored_names if k.startswith(_MID)]
        if bad:
            errs.append(f"speculators format stores the layer under '{_SPEC}', found {bad[:3]}")
    elif fmt == "sglang" and 0 in cfg.aux_layer_ids:
        errs.append("SGLang aux ids must be >= 0 (id -1 would mean the embeddings, which SGLang cannot capture)")
    if fmt != "speculators" and any(k.startswith(_SPEC) for k in ck.stored_names):
        errs.append(f"midlayer format stores the layer under '{_MID}', found '{_SPEC}' names")
    if sorted(cfg.aux_layer_ids) != list(cfg.aux_layer_ids):
        errs.append(f"eagle_aux_hidden_state_layer_ids {cfg.aux_layer_ids} not ascending: engines concatenate aux "
                    "features in layer order; re-export with specdistill (it permutes fc to match)")
    if target_path is not None:
        _, tcfg = read_target_config(target_path)
        target_layers = tcfg.get("num_hidden_layers")
        if tcfg.get("max_position_embeddings") != cfg.max_position_embeddings:
            errs.append(f"max_position_embeddings {cfg.max_position_embeddings} != the target's "
                        f"{tcfg.get('max_position_embeddings')}: re-export with --target")
    errs += check_tensors(cfg, sd, target_layers)
    _raise(errs, f"{path} failed validation")
    names = sd if fmt != "speculators" else {(_SPEC + k[len(_MID):]) if k.startswith(_MID) else k: v
                                              for k, v in sd.items()}
    return ExportResult(Path(path), fmt, {k: (list(v.shape), str(v.dtype).replace("torch.", ""))
                                          for k, v in names.items()}, warnings, raw)


def load_exported(path, embeddings: Optional[torch.Tensor] = None) -> Eagle3Head:
    """An Eagle3Head from an export in either format (the inverse of export_eagle3). If the export has no
    embed_tokens.weight, pass the target's input embeddings (V, H); otherwise they stay uninitialized."""
    validate_export(path)
    ck = read_checkpoint(path)
    cfg, sd = ck.config, ck.state_dict
    head = Eagle3Head(cfg)
    if "embed_tokens.weight" not in sd and embeddings is not None:
        sd["embed_tokens.weight"] = embeddings
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()},
                                               strict=False)
    if [k for k in missing if k not in optional_tensors(cfg)] or unexpected:
        raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
    return head
