"""How real a converted MoE is: its fidelity to the dense model it came from, and whether its routing specialises.

Fidelity (held-out conversations, loss-mask positions: position t predicts token t+1): perplexity of both models,
top-1 agreement. Routing, per layer, from the ordinary routing profiler (moe/profiler.py): the entropy of the
layer's routing-weight distribution over experts (normalised: 1 = uniform use, 0 = one expert takes everything),
the busiest expert's share, how many experts cover 90% of the routing mass, the router's held-out top-k recall
(on the dense model's MLP inputs, so earlier layers' conversion error does not enter) and how stable the hot set
is across data subsets (code-like vs chat prompts: Jaccard overlap of the hot sets and total variation between the
usage distributions), next to the same numbers between two halves of the chat subset (what sampling noise alone
gives). Knows nothing about files or command lines.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from specdistill.moe.profiler import RoutingProfile, RoutingRecorder, profile_routing, token_mask
from specdistill.moe.router_fit import topk_recall
from specdistill.moe.routing import expert_forward, require_moe


# ---------------------------------------------------------------- pure metrics
def usage_entropy(mass: list[float]) -> float:
    """Entropy of a layer's routing-weight distribution over its E experts divided by log E (E = 1: 0)."""
    p = torch.tensor(mass, dtype=torch.float64)
    if len(mass) < 2 or p.sum() <= 0:
        return 0.0
    p = p / p.sum()
    return float(-(p * p.clamp_min(1e-300).log()).sum() / math.log(len(mass)))


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def total_variation(p: list[float], q: list[float]) -> float:
    """TV distance between two usage distributions (each normalised to sum 1)."""
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    return float(0.5 * (p / p.sum().clamp_min(1e-300) - q / q.sum().clamp_min(1e-300)).abs().sum())


CODE_MARKERS = re.compile(r"```|\bdef \w+\(|^\s*(import|from) [\w.]+|#include|\bfunction\b.*\(|"
                          r"\b(public|private|static) \w+|</?\w+>|=>|;\s*$|\{\s*$", re.M)


def is_code_like(text: str) -> bool:
    """A conversation that shows code (fences, definitions, imports, markup, statement endings)."""
    return len(CODE_MARKERS.findall(text)) >= 2


# ---------------------------------------------------------------- fidelity
@dataclass
class LMComparison:
    tokens: int  # loss-mask positions compared
    dense_nll: float  # mean next-token cross-entropy (nats)
    moe_nll: float
    top1_agreement: float  # share of positions where both models' argmax agree

    @property
    def dense_ppl(self) -> float:
        return math.exp(self.dense_nll)

    @property
    def moe_ppl(self) -> float:
        return math.exp(self.moe_nll)


@torch.no_grad()
def compare_lms(dense, moe, batches, progress=None, recorder: Optional[RoutingRecorder] = None,
                token_selection: str = "all") -> LMComparison:
    """Both models on the same collated batches (input_ids, attention_mask, loss_mask (B, T)). An entered
    `recorder` on `moe` profiles its routing in the same forwards (over `token_selection` tokens)."""
    n, nll_d, nll_m, agree = 0, 0.0, 0.0, 0
    device = next(dense.parameters()).device
    for batch in batches:
        ids, attn = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        if recorder is not None:
            recorder.token_mask = token_mask(batch, token_selection)
        m = batch["loss_mask"][:, :-1].bool().to(device)  # (B, T-1) position t predicts token t+1
        nxt = ids[:, 1:][m]  # (n,)
        ld = dense(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1][m].float()  # (n, V)
        lm = moe(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1][m].float()
        nll_d += float(F.cross_entropy(ld, nxt, reduction="sum"))
        nll_m += float(F.cross_entropy(lm, nxt, reduction="sum"))
        agree += int((ld.argmax(-1) == lm.argmax(-1)).sum())
        n += int(m.sum())
        if progress is not None:
            progress(1)
    if n == 0:
        raise ValueError("the held-out batches have no loss-mask positions to compare the models on")
    return LMComparison(tokens=n, dense_nll=nll_d / n, moe_nll=nll_m / n, top1_agreement=agree / n)


@torch.no_grad()
def heldout_router_recall(moe, dense_mlp_inputs: list[torch.Tensor]) -> list[float]:
    """Per MoE layer: top-k recall of its router against its experts' true output norms, on the given MLP inputs
    (one (N, H) tensor per layer, e.g. the dense model's from convert.capture_mlp_inputs)."""
    out = []
    for i, block in require_moe(moe).items():
        x = dense_mlp_inputs[i].to(block.gate.weight.dtype)
        logits = block.gate(x)[0]  # (N, E)
        norms = torch.stack([expert_forward(block.experts, e, x).norm(dim=-1) for e in range(logits.shape[1])], 1)
        out.append(topk_recall(logits.float(), norms.float(), int(block.gate.top_k)))
    return out


# ---------------------------------------------------------------- the report
@dataclass
class LayerRealness:
    layer: int
    routing_entropy: float  # normalised usage entropy (1 = uniform)
    busiest_share: float  # the busiest expert's share of the routing weight
    experts_for_coverage: int  # fewest experts covering `coverage` of the routing weight
    hot_experts: list[int]
    router_recall: Optional[float]  # held-out top-k recall (chance: k / E)
    code_chat_jaccard: Optional[float] = None  # hot sets of the code and chat subsets
    split_half_jaccard: Optional[float] = None  # hot sets of two halves of the chat subset (noise level)
    code_chat_tv: Optional[float] = None  # usage distributions, code vs chat
    split_half_tv: Optional[float] = None


@dataclass
class RealnessReport:
    num_experts: int
    top_k: int
    coverage: float
    lm: LMComparison
    layers: list[LayerRealness]
    subset_tokens: dict = field(default_factory=dict)  # routed tokens per subset
    notes: list[str] = field(default_factory=list)

    def headline(self) -> dict:
        def mean(key):
            vals = [getattr(r, key) for r in self.layers if getattr(r, key) is not None]
            return round(sum(vals) / len(vals), 4) if vals else None
        return {"dense_ppl": round(self.lm.dense_ppl, 4), "moe_ppl": round(self.lm.moe_ppl, 4),
                "ppl_ratio": round(self.lm.moe_ppl / self.lm.dense_ppl, 4),
                "top1_agreement": round(self.lm.top1_agreement, 4), "heldout_tokens": self.lm.tokens,
                "mean_routing_entropy": mean("routing_entropy"), "mean_busiest_share": mean("busiest_share"),
                "uniform_share": round(1 / self.num_experts, 4),
                "mean_experts_for_coverage": mean("experts_for_coverage"),
                "mean_router_recall": mean("router_recall"), "chance_recall": round(self.top_k / self.num_experts, 4),
                "mean_code_chat_jaccard": mean("code_chat_jaccard"),
                "mean_split_half_jaccard": mean("split_half_jaccard"),
                "mean_code_chat_tv": mean("code_chat_tv"), "mean_split_half_tv": mean("split_half_tv")}

    def to_dict(self) -> dict:
        lm = {**asdict(self.lm), "dense_ppl": self.lm.dense_ppl, "moe_ppl": self.lm.moe_ppl}
        return {"num_experts": self.num_experts, "top_k": self.top_k, "coverage": self.coverage,
                "headline": self.headline(), "lm": lm, "layers": [asdict(r) for r in self.layers],
                "subset_tokens": self.subset_tokens, "notes": self.notes}

    def markdown(self) -> str:
        h = self.headline()
        fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
        cov = f"{self.coverage:.0%}"
        lines = [f"# Realness of the converted MoE ({self.num_experts} experts, top-{self.top_k})", "",
                 "| | value |", "|---|---|",
                 f"| perplexity, dense -> MoE (held-out, {h['heldout_tokens']} tokens) | "
                 f"{h['dense_ppl']:.3f} -> {h['moe_ppl']:.3f} (x{h['ppl_ratio']:.3f}) |",
                 f"| top-1 agreement with the dense model | {h['top1_agreement']:.3f} |",
                 f"| routing entropy (mean over layers; 1 = uniform) | {fmt(h['mean_routing_entropy'])} |",
                 f"| busiest expert's share (mean; uniform {h['uniform_share']}) | {fmt(h['mean_busiest_share'])} |",
                 f"| experts covering {cov} of routing mass (mean) | {fmt(h['mean_experts_for_coverage'])} |",
                 f"| router top-{self.top_k} recall, held-out (chance {h['chance_recall']}) | "
                 f"{fmt(h['mean_router_recall'])} |",
                 f"| hot-set Jaccard code vs chat (split-half chat) | {fmt(h['mean_code_chat_jaccard'])} "
                 f"({fmt(h['mean_split_half_jaccard'])}) |",
                 f"| usage TV code vs chat (split-half chat) | {fmt(h['mean_code_chat_tv'])} "
                 f"({fmt(h['mean_split_half_tv'])}) |",
                 "", f"Subset tokens: {self.subset_tokens}", "",
                 f"| layer | entropy | busiest share | experts for {cov} | router recall | Jaccard code/chat | "
                 "Jaccard split-half | TV code/chat | TV split-half |", "|---|---|---|---|---|---|---|---|---|"]
        for r in self.layers:
            lines.append(f"| {r.layer} | {fmt(r.routing_entropy)} | {fmt(r.busiest_share)} | "
                         f"{r.experts_for_coverage} | {fmt(r.router_recall)} | {fmt(r.code_chat_jaccard)} | "
                         f"{fmt(r.split_half_jaccard)} | {fmt(r.code_chat_tv)} | {fmt(r.split_half_tv)} |")
        return "\n".join(lines + [""] + [f"- {n}" for n in self.notes]) + "\n"


def _profile(moe, batches, token_selection, progress) -> Optional[RoutingProfile]:
    if not batches:
        return None
    return profile_routing(moe, _ticking(batches, progress), token_selection)


def _ticking(batches, progress):
    for b in batches:
        yield b
        if progress is not None:
            progress(1)


def merge_profiles(a: RoutingProfile, b: RoutingProfile) -> RoutingProfile:
    """The profile of a's and b's tokens together (same model)."""
    add = lambda x, y: [[u + v for u, v in zip(r, s)] for r, s in zip(x, y)]  # noqa: E731
    return RoutingProfile(a.model_type, a.num_experts, a.top_k, a.layers, add(a.counts, b.counts),
                          add(a.weight_mass, b.weight_mass), add(a.prob_mass, b.prob_mass), a.tokens + b.tokens,
                          a.token_selection)


def realness_report(dense, moe, heldout: list[dict], subsets: dict[str, list[dict]], dense_mlp_inputs=None,
                    coverage: float = 0.9, token_selection: str = "all", progress=None) -> RealnessReport:
    """`heldout`: collated batches for fidelity and the overall routing profile; `subsets`: {"code": batches,
    "chat": batches} for stability (either may be empty); `dense_mlp_inputs`: per layer (N, H) dense MLP inputs on
    held-out tokens for the router's recall (None: not measured). `progress(n)` ticks once per batch.
    Each batch runs once per model: the held-out profile is recorded in the fidelity forwards, and the chat
    profile is the sum of its two halves' (the split-half baseline)."""
    with RoutingRecorder(moe) as rec:
        lm = compare_lms(dense, moe, heldout, progress, rec, token_selection)
    overall = rec.profile(moe.config.model_type, token_selection)
    chat = subsets.get("chat") or []
    profs = {name: _profile(moe, b, token_selection, progress) for name, b in
             (("code", subsets.get("code") or []), ("chat_a", chat[0::2]), ("chat_b", chat[1::2]))}
    profs["chat"] = (merge_profiles(profs["chat_a"], profs["chat_b"]) if profs["chat_b"] is not None
                     else profs["chat_a"])
    recall = heldout_router_recall(moe, dense_mlp_inputs) if dense_mlp_inputs is not None else None
    notes = []
    if profs["code"] is None or profs["chat"] is None:
        notes.append("a subset (code or chat) is empty: no code/chat stability numbers")
    if profs["chat_b"] is None:
        notes.append("fewer than 2 chat batches: no split-half baseline")
    layers = []
    for i, layer in enumerate(overall.layers):
        r = overall.row(layer)
        hot = {n: (p.hot_experts(layer, coverage=coverage) if p is not None else None) for n, p in profs.items()}
        mass = {n: (p.weight_mass[p.row(layer)] if p is not None else None) for n, p in profs.items()}
        both = lambda a, b, f: f(a, b) if a is not None and b is not None else None  # noqa: E731
        total = sum(overall.weight_mass[r]) or 1.0
        hot_all = overall.hot_experts(layer, coverage=coverage)
        layers.append(LayerRealness(
            layer=layer, routing_entropy=round(usage_entropy(overall.weight_mass[r]), 4),
            busiest_share=round(max(overall.weight_mass[r]) / total, 4), experts_for_coverage=len(hot_all),
            hot_experts=hot_all, router_recall=round(recall[i], 4) if recall is not None else None,
            code_chat_jaccard=both(hot["code"], hot["chat"], jaccard),
            split_half_jaccard=both(hot["chat_a"], hot["chat_b"], jaccard),
            code_chat_tv=both(mass["code"], mass["chat"], total_variation),
            split_half_tv=both(mass["chat_a"], mass["chat_b"], total_variation)))
    subset_tokens = {n: p.tokens for n, p in profs.items() if p is not None}
    subset_tokens["heldout"] = overall.tokens
    return RealnessReport(num_experts=overall.num_experts, top_k=overall.top_k, coverage=coverage, lm=lm,
                          layers=layers, subset_tokens=subset_tokens, notes=notes)
