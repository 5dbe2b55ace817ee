"""Drafts built from an MoE target's most used experts (expert-selective drafting).

Three constructions, all chosen in `draft.moe` (specdistill/config.py:MoEDraftConfig):
- kind=moe: a standalone MoE LM of the target's own class from selected target layers, each keeping only its hot
  experts: router rows and expert weights sliced, draft top-k = min(target top-k, kept). The router's softmax
  over the kept rows is the target's distribution conditioned on the kept set, then the model's own top-k
  renormalisation applies; so a token whose target top-k all survive gets exactly the target's expert weights
  (routers that renormalise top-k: Mixtral, norm_topk_prob=true) and keeping every expert reproduces the layer.
- kind=dense: the same layers with one MLP per layer merged from the hot experts, weighted by routing mass.
  `merge=concat` stacks the experts' neurons (intermediate k*I, down_proj scaled by the mass weights), so the MLP
  computes the mass-weighted mean of the expert outputs and has the MoE draft's parameter count (minus the
  router); `merge=average` averages the weights (intermediate I). It is stored as the target's class with one
  expert and top-1 routing: softmax over one logit is 1, so the block is a plain dense SwiGLU MLP that still
  loads and exports as the target's architecture.
- EAGLE-3 heads on an MoE target: the head's MLP is merged (as above) from the hot experts of the last layers.
Every standalone draft records its provenance in `config.specdistill_moe` (source layers, kept experts, kind):
the expert-level loss (objectives/moe_kd.py) reads it to pair draft experts with their source experts.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from specdistill.moe.profiler import RoutingProfile
from specdistill.moe.routing import decoder_layers, expert_count_key, expert_intermediate_key, require_moe

DRAFT_KINDS = ("moe", "dense")
MERGES = ("concat", "average")


SELECTIONS = ("hot", "random", "cold")


def select_experts(profile: RoutingProfile, layers: list[int], coverage: Optional[float] = None,
                   count: Optional[int] = None, selection: str = "hot", seed: int = 0) -> dict[int, list[int]]:
    """Kept expert ids per source layer (ascending: the order a sliced router keeps), the same count in every layer.

    The count: `count`, or with `coverage` the largest number of hot experts any layer needs to reach it (an HF
    config has one expert count for all layers). Which experts (`selection`), at that equal count:
      hot:    the most used by routing weight (profile.ranked);
      cold:   the least used (the control that should lose);
      random: a uniform draw without replacement, seeded by (seed, layer) so a rerun keeps the same ids.
    """
    if selection not in SELECTIONS:
        raise ValueError(f"draft.moe.selection={selection!r}: choose one of {SELECTIONS}")
    k = count if count is not None else max(len(profile.hot_experts(s, coverage=coverage)) for s in layers)
    if not 1 <= k <= profile.num_experts:
        raise ValueError(f"expert count {k} must be in [1, {profile.num_experts}] (draft.moe.num_experts)")
    chosen = {}
    for s in layers:
        if selection == "hot":
            ids = profile.ranked(s)[:k]
        elif selection == "cold":
            ids = profile.ranked(s)[-k:]
        else:
            g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(s))
            ids = torch.randperm(profile.num_experts, generator=g)[:k].tolist()
        chosen[s] = sorted(ids)
    return chosen


def selection_record(profile: RoutingProfile, experts: dict[int, list[int]], selection: str, seed: int) -> dict:
    """What a draft records about its experts (config.specdistill_moe): how they were chosen and, per source
    layer, the share of the target's routing weight they hold (1.0 = every routed token's weight)."""
    return {"selection": selection, "selection_seed": int(seed) if selection == "random" else None,
            "coverage": [round(profile.coverage(s, ids), 4) for s, ids in experts.items()]}


def mass_weights(profile: RoutingProfile, layer: int, experts: list[int]) -> torch.Tensor:
    """Routing-mass weights of `experts` in `layer`, normalised to sum 1 (uniform if none was ever routed)."""
    r = profile.row(layer)
    w = torch.tensor([profile.weight_mass[r][e] for e in experts], dtype=torch.float64)
    return (w / w.sum()) if w.sum() > 0 else torch.full_like(w, 1.0 / len(experts))


def merge_experts(experts_list: list[tuple[nn.Module, int, float]], merge: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge (experts module, expert id, weight) triples into one SwiGLU MLP -> (gate_up (2I', H), down (H, I')).
    concat: I' = sum of the experts' I, output = sum_e w_e f_e(x). average: I' = I, weights = sum_e w_e W_e."""
    if merge not in MERGES:
        raise ValueError(f"draft.moe.merge={merge!r}: choose one of {MERGES}")
    gates, ups, downs = [], [], []
    for ex, e, _ in experts_list:
        g, u = ex.gate_up_proj[e].detach().chunk(2, dim=0)  # (I, H) each
        gates.append(g), ups.append(u), downs.append(ex.down_proj[e].detach())  # (H, I)
    ws = [w for _, _, w in experts_list]
    if merge == "concat":
        gate_up = torch.cat([torch.cat(gates, 0), torch.cat(ups, 0)], 0)  # (2 * sum I, H)
        down = torch.cat([w * d for w, d in zip(ws, downs)], 1)  # (H, sum I)
    else:
        gate_up = torch.cat([sum(w * g for w, g in zip(ws, gates)), sum(w * u for w, u in zip(ws, ups))], 0)
        down = sum(w * d for w, d in zip(ws, downs))
    return gate_up, down


def _draft_config(tcfg, layers: list[int], n_experts: int, top_k: int, intermediate: Optional[int], meta: dict):
    dcfg = copy.deepcopy(tcfg)
    dcfg.num_hidden_layers = len(layers)
    if getattr(dcfg, "layer_types", None):
        dcfg.layer_types = [tcfg.layer_types[s] for s in layers]
    setattr(dcfg, expert_count_key(dcfg), n_experts)
    dcfg.num_experts_per_tok = top_k
    if intermediate is not None:
        setattr(dcfg, expert_intermediate_key(dcfg), intermediate)
    if hasattr(dcfg, "mlp_only_layers"):  # Qwen2/3-MoE: every draft layer is a sparse block (the sources are)
        dcfg.mlp_only_layers = []
        dcfg.decoder_sparse_step = 1
    dcfg.output_router_logits = False
    dcfg.specdistill_moe = meta
    return dcfg


def build_moe_draft(target_model, layers: list[int], experts: dict[int, list[int]], kind: str = "moe",
                    top_k: Optional[int] = None, merge: str = "concat",
                    profile: Optional[RoutingProfile] = None) -> nn.Module:
    """A standalone draft LM from target `layers` (in order) keeping `experts[s]` of each source layer s.
    kind=moe: sliced routers and experts; kind=dense: one merged MLP per layer (needs `profile` for the mass
    weights). Embeddings, final norm and head are copied from the target."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft.moe.kind={kind!r}: choose one of {DRAFT_KINDS}")
    blocks = require_moe(target_model)
    tcfg = target_model.config
    dense_src = [s for s in layers if s not in blocks]
    if dense_src:
        raise ValueError(f"draft.moe.layers {dense_src} are not MoE layers of the target "
                         f"(MoE layers: {sorted(blocks)})")
    counts = {len(experts[s]) for s in layers}
    if len(counts) != 1:
        raise ValueError(f"every draft layer must keep the same number of experts (one HF config), got {counts}")
    k = counts.pop()
    E = blocks[layers[0]].gate.weight.shape[0]
    for s in layers:
        if sorted(set(experts[s])) != sorted(experts[s]) or not all(0 <= e < E for e in experts[s]):
            raise ValueError(f"layer {s}: kept experts {experts[s]} must be distinct ids in [0, {E})")
    t_top_k = int(blocks[layers[0]].gate.top_k)
    meta = {"kind": kind, "source_layers": list(layers), "experts": [list(experts[s]) for s in layers],
            "target_num_experts": int(E), "target_top_k": t_top_k}
    if kind == "moe":
        draft_top_k = min(top_k or t_top_k, k)
        dcfg = _draft_config(tcfg, layers, k, draft_top_k, None, meta)
    else:
        if profile is None:
            raise ValueError("a dense merged draft needs a routing profile for its mass weights")
        I = blocks[layers[0]].experts.gate_up_proj.shape[1] // 2
        weights = {s: mass_weights(profile, s, experts[s]) for s in layers}
        meta.update(merge=merge, merge_weights=[[round(float(w), 6) for w in weights[s]] for s in layers])
        dcfg = _draft_config(tcfg, layers, 1, 1, I * k if merge == "concat" else I, meta)
    draft = type(target_model)(dcfg)

    # Embeddings, final norm, head: the target's (the decoder layers are loaded one by one below).
    sd = {k_: v for k_, v in target_model.state_dict().items() if ".layers." not in k_}
    missing, _ = draft.load_state_dict(sd, strict=False)
    t_layers, d_layers = decoder_layers(target_model), decoder_layers(draft)
    with torch.no_grad():
        for j, s in enumerate(layers):
            src = t_layers[s].state_dict()
            keep = torch.tensor(experts[s], dtype=torch.long)
            if kind == "moe":
                for name, v in list(src.items()):  # router rows and expert weights: first dim E
                    if name.startswith(("mlp.gate.", "mlp.experts.")) and v.dim() >= 1 and v.shape[0] == E:
                        src[name] = v.index_select(0, keep)
            else:
                gate_up, down = merge_experts([(blocks[s].experts, e, float(w)) for e, w in
                                              zip(experts[s], weights[s])], merge)
                src["mlp.experts.gate_up_proj"], src["mlp.experts.down_proj"] = gate_up[None], down[None]
                for name, v in list(src.items()):
                    if name.startswith("mlp.gate.") and v.dim() >= 1 and v.shape[0] == E:
                        src[name] = torch.zeros_like(v[:1])  # one expert: softmax of one logit is 1
            d_layers[j].load_state_dict(src, strict=True)
    missing = [m for m in missing if ".layers." not in m and not _is_tied(draft, m)]
    if missing:
        raise RuntimeError(f"MoE draft built from the target is missing weights {missing[:5]}")
    return draft


def _is_tied(model, key: str) -> bool:
    return key == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


def draft_param_count(model) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def init_eagle3_mlp_from_experts(head, target_model, profile: RoutingProfile, layers: Optional[list[int]] = None,
                                 coverage: Optional[float] = None, count: Optional[int] = None,
                                 merge: str = "concat", selection: str = "hot", seed: int = 0) -> dict:
    """Replace an EAGLE-3 head's MLP by a merge of the hot experts of target `layers` (default: the last MoE layer),
    weighted by routing mass over all (layer, expert) pairs. The head's intermediate size becomes the merged size
    (written into its config, so the export carries it). Returns what was merged."""
    from specdistill.models.layers import GatedMLP

    blocks = require_moe(target_model)
    layers = list(layers) if layers else [max(blocks)]
    chosen = select_experts(profile, layers, coverage, count, selection, seed)
    pairs = [(s, e) for s in layers for e in chosen[s]]
    mass = torch.tensor([profile.weight_mass[profile.row(s)][e] for s, e in pairs], dtype=torch.float64)
    w = mass / mass.sum() if mass.sum() > 0 else torch.full_like(mass, 1.0 / len(pairs))
    triples = [(blocks[s].experts, e, float(w_)) for (s, e), w_ in zip(pairs, w)]
    gate_up, down = merge_experts(triples, merge)
    inter = down.shape[1]
    head.config.intermediate_size = inter
    mlp = GatedMLP(head.config.hidden_size, head.config.intermediate_size)
    with torch.no_grad():
        g, u = gate_up.chunk(2, dim=0)
        mlp.gate_proj.weight.copy_(g), mlp.up_proj.weight.copy_(u), mlp.down_proj.weight.copy_(down)
    head.midlayer.mlp = mlp.to(next(head.parameters()).dtype)
    return {"layers": layers, "experts": [chosen[s] for s in layers], "merge": merge, "intermediate_size": inter,
            **selection_record(profile, chosen, selection, seed)}
