"""A head trained by a peer, rewritten as specdistill's EAGLE-3 head and exported in the vLLM midlayer format with the
target's embeddings (drafts/eagle3/export.py validates it tensor by tensor).

What each peer saves (0.x releases) and what maps to the served layout:
  speculators  save_pretrained of its Eagle3DraftModel: `layers.0.*` (-> `midlayer.*`), fc, norm, lm_head, d2t, t2d,
               embed_tokens, and with its defaults `input_norm` (an RMSNorm over the three concatenated aux states
               before fc: norm_before_fc). Its config flags norm_before_residual (the residual after attention is
               hidden_norm(g) instead of g) and norm_output (the TTT feedback is the post-norm state).
  specforge    save_pretrained of LlamaForCausalLMEagle3: already midlayer names (fc, midlayer.*, norm, lm_head, d2t,
               t2d, embed_tokens); `fc_norm.*` when trained with per-layer aux norms. Its ids count layer outputs.
  modelopt     the HF model converted by modelopt.torch.speculative: `eagle_module.layers.0.*`, eagle_module.fc,
               eagle_module.norm, eagle_module.lm_head, eagle_module.d2t (offsets, no t2d). Its first layer is the HF
               Llama layer, whose own input_layernorm runs on the fused feature g before the EAGLE-3 hidden_norm; the
               same weight normalizes the token embedding. Its ids count layer outputs.
A peer default the served layout cannot hold is dropped and named in Converted.inexact, with a measure of how far the
dropped piece is from doing nothing, so a score of such a head is labelled approximate.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from benchmarks.peers.arms import our_aux_ids

MIDLAYER_PARTS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass
class Converted:
    state_dict: dict[str, torch.Tensor]  # midlayer names, without embed_tokens (the target's are added on export)
    aux_layer_ids: list[int]  # specdistill convention
    inexact: list[str] = field(default_factory=list)  # peer features dropped, each with its size

    @property
    def exact(self) -> bool:
        return not self.inexact


def vocab_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d (V,) bool from d2t offsets (target id = draft id + d2t[draft id])."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t.long()] = True
    return t2d


def _norm_spread(w: torch.Tensor) -> float:
    """How far a norm's gain is from one constant (max |w - mean| / |mean|): 0 means the norm only rescales, which the
    next RMS norm undoes (up to eps)."""
    w = w.float()
    m = w.mean().abs().item() + 1e-12
    return float((w - w.mean()).abs().max().item() / m)


def _midlayer(sd: dict, prefix: str) -> dict[str, torch.Tensor]:
    missing = [p for p in MIDLAYER_PARTS if prefix + p not in sd]
    if missing:
        raise ValueError(f"peer head lacks {[prefix + p for p in missing][:4]}: not an EAGLE-3 head of the expected "
                         "layout (one decoder layer)")
    return {"midlayer." + p: sd[prefix + p] for p in MIDLAYER_PARTS}


def _common(sd: dict, prefix: str, keys=("fc.weight", "norm.weight", "lm_head.weight")) -> dict[str, torch.Tensor]:
    missing = [prefix + k for k in keys if prefix + k not in sd]
    if missing:
        raise ValueError(f"peer head lacks {missing}")
    return {k: sd[prefix + k] for k in keys}


def convert_speculators(sd: dict[str, torch.Tensor], config: dict) -> Converted:
    """speculators' Eagle3DraftModel checkpoint -> midlayer."""
    extra_layers = sorted({k.split(".")[1] for k in sd if k.startswith("layers.") and not k.startswith("layers.0.")})
    if extra_layers:
        raise ValueError(f"speculators head has layers {['0'] + extra_layers}: the served layout holds one layer")
    out = {**_common(sd, ""), **_midlayer(sd, "layers.0.")}
    vocab = (config.get("transformer_layer_config") or {}).get("vocab_size") or config.get("vocab_size")
    if "d2t" in sd:
        out["d2t"] = sd["d2t"].long()
        out["t2d"] = sd["t2d"].bool() if "t2d" in sd else vocab_from_d2t(sd["d2t"], int(vocab))
    inexact = []
    if "input_norm.weight" in sd:
        inexact.append("norm_before_fc: an RMSNorm over the concatenated aux states before fc (nonlinear: a per-token "
                       f"1/rms scale fc cannot hold); gain spread {_norm_spread(sd['input_norm.weight']):.3g}")
    fc_norms = sorted(k for k in sd if k.startswith("fc_norm."))
    if fc_norms:
        inexact.append(f"fc_norm: per-layer RMSNorms on each aux state before fc ({len(fc_norms)} tensors)")
    if config.get("norm_before_residual", False):
        inexact.append("norm_before_residual: the attention residual is hidden_norm(g), the served layout adds g")
    if config.get("norm_output", False):
        inexact.append("norm_output: TTT fed the post-norm state back, the served layout feeds the pre-norm state")
    aux = config.get("eagle_aux_hidden_state_layer_ids") or []
    return Converted(out, our_aux_ids("speculators", list(aux)), inexact)


def convert_specforge(sd: dict[str, torch.Tensor], config: dict) -> Converted:
    """SpecForge's LlamaForCausalLMEagle3 checkpoint -> midlayer (its names are the served ones)."""
    out = {**_common(sd, ""), **_midlayer(sd, "midlayer.")}
    if "d2t" in sd:
        out["d2t"] = sd["d2t"].long()
        out["t2d"] = sd["t2d"].bool() if "t2d" in sd else vocab_from_d2t(sd["d2t"], int(config["vocab_size"]))
    inexact = []
    if any(k.startswith("fc_norm.") for k in sd):
        inexact.append("fc_norm: per-layer RMSNorms on each aux state before fc")
    if config.get("norm_output", True) is False:
        inexact.append("norm_output=false: logits read the un-normed state, the served layout applies norm")
    aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or config.get("eagle_aux_hidden_state_layer_ids") or []
    return Converted(out, our_aux_ids("specforge", list(aux)), inexact)


def convert_modelopt(sd: dict[str, torch.Tensor], config: dict) -> Converted:
    """ModelOpt's eagle_module (from the converted HF model's state dict) -> midlayer."""
    p = "eagle_module."
    sd = {k: v for k, v in sd.items() if k.startswith(p)}
    extra_layers = sorted({k.split(".")[2] for k in sd if k.startswith(p + "layers.") and
                           not k.startswith(p + "layers.0.")})
    if extra_layers:
        raise ValueError(f"ModelOpt head has layers {['0'] + extra_layers}: the served layout holds one layer")
    keys = ("fc.weight", "lm_head.weight") + (("norm.weight",) if p + "norm.weight" in sd else ())
    out = {**_common(sd, p, keys), **_midlayer(sd, p + "layers.0.")}
    inexact = []
    if "norm.weight" not in out:
        out["norm.weight"] = torch.ones_like(out["midlayer.hidden_norm.weight"])
        inexact.append("use_last_layernorm=false: logits read the un-normed state, the served layout applies norm")
    vocab = int(config["vocab_size"])
    if p + "d2t" in sd:
        out["d2t"] = sd[p + "d2t"].long()
        out["t2d"] = vocab_from_d2t(sd[p + "d2t"], vocab)
    if config.get("use_input_layernorm_in_first_layer", True):
        inexact.append("input_layernorm before hidden_norm: training ran hidden_norm(input_layernorm(g)), the served "
                       "layout hidden_norm(g); equal when input_layernorm's gain is one constant, spread "
                       f"{_norm_spread(out['midlayer.input_layernorm.weight']):.3g}")
    aux = config.get("eagle_aux_hidden_state_layer_ids") or []
    return Converted(out, our_aux_ids("modelopt", list(aux)), inexact)


CONVERTERS = {"speculators": convert_speculators, "specforge": convert_specforge, "modelopt": convert_modelopt}


def read_peer_head(folder) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config.json) of a saved peer head folder (safetensors shards, or a torch .pt state dict)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    if not sd:
        for f in sorted(folder.glob("*.pt")) + sorted(folder.glob("*.bin")):
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
    if not sd:
        raise FileNotFoundError(f"{folder} holds no *.safetensors / *.pt / *.bin weights")
    cfg_file = folder / "config.json"
    config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    return sd, config


def to_head(conv: Converted, target_model):
    """The converted weights in a specdistill Eagle3Head for `target_model` (its embeddings, RoPE and vocabulary)."""
    from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head
    from specdistill.models.target import embedding_scale

    sd = conv.state_dict
    vd = sd["lm_head.weight"].shape[0]
    cfg = Eagle3Config.from_target(target_model.config, vd, conv.aux_layer_ids, embedding_scale(target_model))
    cfg.intermediate_size = int(sd["midlayer.mlp.gate_proj.weight"].shape[0])
    cfg.num_key_value_heads = int(sd["midlayer.self_attn.k_proj.weight"].shape[0]) // cfg.head_dim
    cfg.num_attention_heads = int(sd["midlayer.self_attn.q_proj.weight"].shape[0]) // cfg.head_dim
    head = Eagle3Head(cfg)
    full = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    full["embed_tokens.weight"] = target_model.get_input_embeddings().weight.detach().float().cpu()
    if "d2t" not in full:  # a full-vocabulary head
        full["d2t"], full["t2d"] = head.d2t.clone(), head.t2d.clone()
    head.load_state_dict(full, strict=True)
    return head


def agreement(head, ids: torch.Tensor, aux: torch.Tensor, peer_argmax: list[int]) -> float:
    """Fraction of slots where the converted head's step-0 prediction (specdistill's forward) equals the peer's own
    forward's (peer_train.py probes): 1.0 for an exact conversion, below it by what the dropped pieces changed."""
    with torch.no_grad():
        logits = head(aux[None].float(), ids[None], torch.ones(1, len(ids), dtype=torch.long), steps=1)[0]
    ours = logits[0, : len(ids) - 1].argmax(-1)  # slot t reads token t+1: slots 0 .. T-2, as the probes
    theirs = torch.tensor(peer_argmax[: len(ours)])
    return float((ours[: len(theirs)] == theirs).float().mean())


def export_converted(conv: Converted, target_model, target_path: str, out_dir, head_dir: Optional[Path] = None,
                     overwrite: bool = True) -> dict:
    """Write the head folder and its validated vLLM export with the target's embeddings; returns what was written."""
    from specdistill.drafts.eagle3.export import export_eagle3

    out_dir = Path(out_dir)
    head_dir = Path(head_dir or out_dir.with_name(out_dir.name + "_head"))
    head = to_head(conv, target_model)
    head.save_pretrained(head_dir)
    res = export_eagle3(head_dir, out_dir, fmt="vllm", target_path=target_path, include_embeddings=True,
                        overwrite=overwrite)
    return {"export": str(out_dir), "head": str(head_dir), "exact": conv.exact, "inexact": conv.inexact,
            "aux_layer_ids": conv.aux_layer_ids, "warnings": res.warnings, "_head": head}
