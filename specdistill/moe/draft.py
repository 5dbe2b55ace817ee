"""Config -> expert-selective draft: load or compute the target's routing profile, pick experts
(draft.moe.selection: hot / random / cold, equal count), build."""
from __future__ import annotations

from typing import Optional

from specdistill.moe.build import build_moe_draft, init_eagle3_mlp_from_experts, select_experts, selection_record
from specdistill.moe.profiler import RoutingProfile, calibration_batches, profile_routing
from specdistill.moe.routing import require_moe
from specdistill.tokens import pad_id


def routing_profile(moe_cfg, target_model, data=None, log=print) -> RoutingProfile:
    """draft.moe.profile if set, else a profile of the first profile_batches x 4 training rows."""
    if moe_cfg.profile:
        prof = RoutingProfile.load(moe_cfg.profile)
        blocks = require_moe(target_model)
        E = int(next(iter(blocks.values())).gate.weight.shape[0])
        if prof.layers != sorted(blocks) or prof.num_experts != E:
            raise ValueError(f"routing profile {moe_cfg.profile} (layers {prof.layers[:4]}..., {prof.num_experts} "
                             f"experts) was not made for this target ({len(blocks)} MoE layers, {E} experts)")
        return prof
    if data is None:
        raise ValueError("draft.init=moe_experts needs a routing profile: set draft.moe.profile=<profile.json from "
                         "scripts/profile_moe.py>, or build through specdistill.build (it profiles the training data)")
    p = target_model.config.pad_token_id
    pad = pad_id(None, None if p is None else [p])  # the config's pad id, else 0 (padded slots are masked)
    batches = calibration_batches(data.train, pad, moe_cfg.profile_batches)
    prof = profile_routing(target_model, batches, moe_cfg.token_selection,
                           source={"data": getattr(data, "fingerprint", ""),
                                   "rows": sum(len(b["input_ids"]) for b in batches)})
    log(f"[moe] routing profile of {prof.tokens} {prof.token_selection} tokens over {len(prof.layers)} MoE layers")
    return prof


def _selection(moe_cfg) -> tuple[Optional[float], Optional[int]]:
    if moe_cfg.num_experts is not None:
        return None, moe_cfg.num_experts
    if moe_cfg.coverage is None:
        raise ValueError("set draft.moe.coverage (a routing-weight share) or draft.moe.num_experts (a fixed count)")
    return moe_cfg.coverage, None


def build_from_config(cfg, target_model, data=None, log=print):
    """draft.init=moe_experts: layers draft.moe.layers (null = the first draft.num_layers MoE layers)."""
    m = cfg.moe
    blocks = require_moe(target_model)
    layers = list(m.layers) if m.layers else sorted(blocks)[: cfg.num_layers]
    if not layers:
        raise ValueError("draft.moe.layers is empty")
    prof = routing_profile(m, target_model, data, log)
    coverage, count = _selection(m)
    experts = select_experts(prof, layers, coverage, count, m.selection, m.selection_seed)
    draft = build_moe_draft(target_model, layers, experts, m.kind, m.top_k, m.merge, prof)
    record = selection_record(prof, experts, m.selection, m.selection_seed)
    draft.config.specdistill_moe.update(record)  # saved with the draft's config.json
    log(f"[moe] {m.kind} draft from target layers {layers}: {m.selection} experts {[experts[s] for s in layers]}, "
        f"routing-weight coverage {record['coverage']}")
    return draft


def init_eagle3_from_config(head, draft_cfg, target_model, data=None, log=print) -> dict:
    """init=eagle3 with draft.moe.eagle3_mlp=true: the head's MLP merged from hot experts of the last layers."""
    m = draft_cfg.moe
    prof = routing_profile(m, target_model, data, log)
    coverage, count = _selection(m)
    info = init_eagle3_mlp_from_experts(head, target_model, prof, m.eagle3_layers, coverage, count, m.merge,
                                        m.selection, m.selection_seed)
    log(f"[moe] EAGLE-3 MLP merged ({info['merge']}) from layers {info['layers']} {info['selection']} experts "
        f"{info['experts']} (coverage {info['coverage']}): "
        f"intermediate {info['intermediate_size']}")
    return info
