"""The cost model for chains and token trees: the target's verify cost v(k) of k tokens in one forward, the draft's cost
per round, and the setting (chain length or tree shape) with the highest predicted speed.

Units are target steps (one KV-cached forward of 1 token per row). A setting whose rounds emit tau tokens, cost the
draft d steps, verify k tokens and spend o steps on the round's bookkeeping (verification, cache commits, host syncs)
runs at
    predicted speedup = tau' * b / (d + v(k) + o),     tau' = tau / (1 + tau / 2T)
where b is one step of target-only decoding, its bookkeeping included, and tau' counts each row's last round, cut
short by its budget of T tokens (b = 1, o = 0, T infinite when not measured: the plain cost model of every
evaluation). A chain of gamma: d = gamma * c, k = gamma + 1; a tree of N nodes: d = its
propose time, k = N + 1.
Chains' tau for every gamma up to the measured one follows from the measured acceptance rates a_k:
tau(gamma) = 1 + sum_{k <= gamma} prod_{i <= k} a_i (every round drafting gamma, no row stopping mid-round).
eval.measure_recommended searches tree shapes too (eval/tree_search.py) and measures the recommended setting.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdistill.decoding import Drafter, Sampler
from specdistill.decoding.kv import BatchKV, CacheMode, device_of
from specdistill.decoding.tree import TreeShape
from specdistill.eval.batches import PromptBatch
from specdistill.eval.timing import median_ms, timed


@dataclass
class VerifyCurve:
    """v(k) for k = 1 .. len(ms): one target forward of k tokens per row (a token tree's mask) / one of 1 token."""
    step_ms: float        # one 1-token forward, KV-cached
    ms: list[float]       # ms[k-1]: one forward of k tokens
    context_tokens: int   # the prompt length it was timed at

    def v(self, k: int) -> float:
        if not 1 <= k <= len(self.ms):
            raise ValueError(f"v({k}) was not measured: the curve covers 1..{len(self.ms)} tokens")
        return self.ms[k - 1] / self.step_ms

    @property
    def ratios(self) -> list[float]:
        return [m / self.step_ms for m in self.ms]


@dataclass
class Setting:
    """One decoding setting's measured or predicted tau and its costs in target steps."""
    name: str             # chain4, tree4x3n15 ...
    tau: float            # tokens per round
    draft: float          # draft cost per round / one target step
    width: int            # tokens verified per round (gamma + 1, or nodes + 1)
    verify: float         # v(width)
    flags: dict = field(default_factory=dict)  # SGLang's flags for a tree
    gamma: int | None = None  # a chain's length (None: a tree)
    overhead: float = 0.0     # the round's bookkeeping beyond the draft and verify forwards, in target steps
    baseline: float = 1.0     # one step of target-only decoding (its bookkeeping included), in target steps
    shape: TreeShape | None = None  # a tree's shape (None: a chain)
    coverage: float | None = None   # a searched tree: the share of its scored nodes the probe's trees held
    tokens: float = math.inf        # tokens a row generates (its last round is cut short by the budget or EOS)

    @property
    def effective_tau(self) -> float:
        """Tokens per round with each row's last round cut: a row of T tokens takes about T / tau + 1/2 rounds."""
        return self.tau / (1 + self.tau / (2 * self.tokens))

    @property
    def predicted_speedup(self) -> float:
        return self.effective_tau * self.baseline / (self.draft + self.verify + self.overhead)

    def to_dict(self) -> dict:
        out = {"name": self.name, "tau": self.tau, "effective_tau": self.effective_tau, "draft": self.draft,
               "width": self.width, "verify": self.verify, "overhead": self.overhead,
               "predicted_speedup": self.predicted_speedup}
        if self.flags:
            out["sglang"] = self.flags
        if self.gamma is not None:
            out["gamma"] = self.gamma
        if self.shape is not None:
            out |= {"topk": self.shape.topk, "depth": self.shape.depth, "nodes": self.shape.size}
        if self.coverage is not None:
            out["coverage"] = self.coverage
        return out


def chain_taus(accept_rate_per_pos: list[float]) -> list[float]:
    """tau(gamma) for gamma = 0 .. len(a): 1 + sum_{k <= gamma} prod_{i <= k} a_i."""
    taus, reach = [1.0], 1.0
    for a in accept_rate_per_pos:
        reach *= a
        taus.append(taus[-1] + reach)
    return taus


def chain_settings(accept_rate_per_pos: list[float], c: float, curve: VerifyCurve,
                   draft: Callable[[int], float] | None = None, overhead: float | Callable[[int], float] = 0.0,
                   baseline: float = 1.0) -> list[Setting]:
    """Every chain length 1 .. len(a) (within the curve), tau predicted from the measured a_k. draft(g): a round's
    draft cost in target steps (None: g * c); overhead: Setting's, one for every length or overhead(g); baseline:
    Setting's."""
    taus = chain_taus(accept_rate_per_pos)
    top = min(len(accept_rate_per_pos), len(curve.ms) - 1)
    cost = draft or (lambda g: g * c)
    bookkeeping = overhead if callable(overhead) else (lambda g: overhead)
    return [Setting(f"chain{g}", taus[g], cost(g), g + 1, curve.v(g + 1), flags=TreeShape(1, g).sglang_flags(),
                    gamma=g, overhead=max(0.0, bookkeeping(g)), baseline=baseline) for g in range(1, top + 1)]


def linear(x1: int, y1: float, x2: int, y2: float) -> Callable[[int], float]:
    """The line through (x1, y1) and (x2, y2) (constant y1 when x1 == x2): a round's draft cost between two measured
    lengths (an LM draft or a head: one forward per depth; a block drafter: one forward whatever the length)."""
    if x1 == x2:
        return lambda x: y1
    return lambda x: y1 + (x - x1) * (y2 - y1) / (x2 - x1)


def served(setting: Setting, serves_trees: bool = True) -> bool:
    """Whether a serving engine decodes `setting` for the draft: chains (and trees of topk 1) always, wider trees only
    for a draft kind whose trees engines serve (drafts/registry.py: DraftKind.serves_trees; a DFlash drafter's are
    not)."""
    return serves_trees or setting.shape is None or setting.shape.topk == 1


def best(settings: list[Setting], serves_trees: bool = True) -> Setting:
    """The highest predicted speedup among the settings an engine serves (all of them when none is)."""
    if not settings:
        raise ValueError("no setting to choose from")
    pool = [s for s in settings if served(s, serves_trees)] or settings
    return max(pool, key=lambda s: s.predicted_speedup)


# ------------------------------------------------------------------------------------------------ measurements
@torch.no_grad()
def verify_curve(target_model, batch: PromptBatch, max_width: int = 32, reps: int = 5,
                 cache: CacheMode = CacheMode()) -> VerifyCurve:
    """Time one target forward of k = 1 .. max_width tokens per row at the batch's context, through the tree path
    (positions and a 4D mask as tree verification feeds them), rolled back after each. Medians of `reps`."""
    device = device_of(target_model)
    ids, mask = batch.input_ids, batch.attention_mask
    B = ids.shape[0]
    kv = cache.factory(ids.shape[1] + max_width + 1)(target_model)
    kv.prefill(ids[:, :-1], mask[:, :-1])
    pending = ids[:, -1:]

    def forward(k: int):
        visible = torch.ones(k, k, dtype=torch.bool, device=device).tril().expand(B, -1, -1)  # a chain-shaped tree
        kv.step(pending.expand(B, k), positions=kv.length[:, None] + torch.arange(k, device=device),
                tail_visible=visible)
        kv.commit(torch.zeros(B, k, dtype=torch.bool, device=device))

    step_ms = median_ms(device, lambda: _one_step(kv, pending), reps)
    ms = [median_ms(device, lambda k=k: forward(k), reps) for k in range(1, max_width + 1)]
    return VerifyCurve(step_ms, ms, int(mask.sum(1).max()))


def _one_step(kv: BatchKV, tokens: torch.Tensor) -> None:
    """One 1-token forward per row, rolled back."""
    kv.step(tokens)
    kv.commit(torch.zeros_like(tokens, dtype=torch.bool))


@dataclass
class TreeCost:
    shape: str
    nodes: int            # drafted nodes per round; the target verifies nodes + 1
    target_step_ms: float
    draft_round_ms: float  # propose() in the steady state (after a committed round)
    draft_prefill_ms: float  # the first propose() after start()
    verify_ms: float      # one forward of nodes + 1 tokens with the tree's mask
    d: float              # draft_round_ms / target_step_ms
    v: float              # verify_ms / target_step_ms


@torch.no_grad()
def measure_tree_cost(target_model, drafter: Drafter, batch: PromptBatch, shape: TreeShape, reps: int = 5,
                      cache: CacheMode = CacheMode()) -> TreeCost:
    """Time the drafter's propose(shape) in the steady state and the target's verify forward of its tree, at the
    batch's context. Between timed rounds the target verifies the tree and every node is rejected (both caches keep
    the root only), as any later round of a generation follows a committed one."""
    device = device_of(target_model)
    ids, mask = batch.input_ids, batch.attention_mask
    B = ids.shape[0]
    new_kv = cache.factory(ids.shape[1] + (reps + 3) * (shape.size + 2))
    kv: BatchKV = new_kv(target_model)
    hidden = {"output_hidden_states": True} if drafter.needs_hidden_states else {}
    prefill = kv.prefill(ids[:, :-1], mask[:, :-1], **hidden)
    drafter.start(ids, mask, target_hidden=getattr(prefill, "hidden_states", None), new_kv=new_kv)
    greedy = Sampler(0.0)
    tree, first = timed(device, lambda: drafter.propose(shape, greedy))
    pending = ids[:, -1]                                                     # (B,)
    none = torch.zeros(B, dtype=torch.long, device=device)
    going = torch.ones(B, dtype=torch.bool, device=device)

    def verify(tree):
        out = kv.step(torch.cat([pending[:, None], tree.tokens.to(device)], 1), **tree.attention(kv.length), **hidden)
        return out

    draft_times, verify_times = [], []
    for i in range(reps + 1):
        out, t_verify = timed(device, lambda t=tree: verify(t))
        root_only = torch.zeros(B, tree.max_depth + 1, dtype=torch.long, device=device)  # the path of no node
        kv.commit_path(root_only, none + 1)                                  # keep the root: the round's pending token
        pending = out.logits[:, 0].argmax(-1)
        root_hidden = None if not hidden else tuple(h[:, :1] for h in out.hidden_states)
        drafter.commit(none, pending, going, target_hidden=root_hidden, path=None if tree.is_chain else root_only)
        tree, t_draft = timed(device, lambda: drafter.propose(shape, greedy))
        if i:  # the first steady round is a warm-up
            draft_times.append(t_draft)
            verify_times.append(t_verify)
    step_ms = median_ms(device, lambda: _one_step(kv, pending[:, None]), reps)
    draft_ms, verify_ms = 1000 * statistics.median(draft_times), 1000 * statistics.median(verify_times)
    return TreeCost(shape.name, shape.size, step_ms, draft_ms, 1000 * first, verify_ms, draft_ms / step_ms,
                    verify_ms / step_ms)


def tree_setting(shape: TreeShape, tau: float, cost: TreeCost) -> Setting:
    return Setting(shape.name, tau, cost.d, shape.size + 1, cost.v, flags=shape.sglang_flags(), shape=shape)


# ------------------------------------------------------------------------------------------------ the report
def cost_model_report(curve: VerifyCurve, settings: list[Setting], serves_trees: bool = True) -> dict:
    """The evaluator's cost_model entry: v(k) for k = 1 .. len(curve), each setting's predicted speedup, and the
    recommended one: the highest predicted that an engine serves. serves_trees=False (a draft whose trees no engine
    decodes): its trees stay as candidates without engine flags, and the recommendation is a chain."""
    rec = best(settings, serves_trees)
    rows = []
    for s in settings:
        row = s.to_dict()
        if not served(s, serves_trees):
            row.pop("sglang", None)
            row["served"] = False  # specdistill's decoding only
        rows.append(row)
    return {"target_step_ms": curve.step_ms, "context_tokens": curve.context_tokens,
            "v_curve": curve.ratios, "v_curve_ms": curve.ms,
            "settings": rows,
            "recommended": rec.name, "recommended_predicted_speedup": rec.predicted_speedup,
            **({"recommended_sglang": rec.flags} if rec.flags and served(rec, serves_trees) else {}),
            **({} if serves_trees else {"engines_serve_trees": False})}


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def cost_model_markdown(m: dict) -> list[str]:
    """results.md's cost-model section: the candidates (the measured ones marked), the recommended setting with its
    SGLang flags, predicted against measured, and v(k)."""
    measured = m.get("measured")
    marks = {} if measured is None else {measured["name"]: measured}
    if m.get("main"):
        marks.setdefault(m["main"]["name"], m["main"])
    tokens = m.get("tokens_per_row")
    lines = ["", "## Cost model", "", "predicted speedup = tau' * b / (draft + v(width) + o), in target steps "
             f"(b = {_f(m.get('baseline', 1.0))}: a step of target-only decoding; o: the round's bookkeeping; "
             "tau' = tau / (1 + tau / 2T): each row's last round cut at its "
             + ("budget)" if tokens is None else f"T = {_f(tokens, 1)} tokens)"), "",
             "| setting | predicted tau | tau' | draft | width | v(width) | o | predicted speedup | measured decode "
             "speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for s in m["settings"]:
        mk = marks.get(s["name"])
        seen = "-" if mk is None else f"**{_f(mk['decode_speedup'])}x** (tau {_f(mk['mean_accept_len'])})"
        lines.append(f"| {s['name']} | {_f(s['tau'])} | {_f(s.get('effective_tau', s['tau']))} | {_f(s['draft'])} "
                     f"| {s['width']} | {_f(s['verify'])} "
                     f"| {_f(s.get('overhead', 0.0))} | {_f(s['predicted_speedup'])} | {seen} |")
    flags = m.get("recommended_sglang")
    serve = "" if not flags else " (SGLang: `" + " ".join(f"{k} {v}" for k, v in flags.items()) + "`)"
    lines += ["", f"Recommended: **{m['recommended']}**{serve}, predicted {_f(m['recommended_predicted_speedup'])}x"
              + ("" if measured is None else f", measured {_f(measured['speedup'])}x (tau "
                                             f"{_f(measured['mean_accept_len'])})") + "."]
    if measured is not None and measured.get("ratio") is not None:
        verdict = ("within 10% of the prediction" if measured["within_10pct"] else
                   "**off by more than 10%: the cost model mispredicts this setting on this machine**")
        lines.append(f"Decode speedup (prefill excluded) measured {_f(measured['decode_speedup'])}x against predicted "
                     f"{_f(measured['predicted_speedup'])}x: ratio {_f(measured['ratio'])}, {verdict}."
                     + (" The recommended pass ran after the measured one and is set against its target-only runs "
                        "(not interleaved: load changes between the two passes enter the ratio)."
                        if measured.get("decoded") else ""))
    if m["recommended_predicted_speedup"] < 1 or (measured is not None and measured["speedup"] < 1):
        lines.append("**Slower than the target alone**: no chain length or tree shape is predicted faster than "
                     "target-only decoding on this machine" + ("" if measured is None else ", and the recommended one "
                     f"measured {_f(measured['speedup'])}x") + "; serve without this draft here (a verify of k tokens "
                     "costs v(k) target steps on this device: where v stays near 1, as on a GPU, the same draft pays).")
    if m.get("main") and measured is not None:
        main = m["main"]
        lines.append(f"Against the configured {main['name']}: {_f(measured['speedup'])}x vs {_f(main['speedup'])}x "
                     "measured (prefill included).")
    if m.get("engines_serve_trees") is False:
        lines.append("Trees of this drafter are specdistill's decoding only (no serving engine decodes them; vLLM "
                     "serves it as chains), so the recommendation is among chains; trees are listed for comparison.")
    for note in m.get("notes", []):
        lines.append(f"Note: {note}")
    lines += ["", "v(k) for k = 1..32: " + ", ".join(_f(v, 2) for v in m["v_curve"])]
    return lines


def tree_report(shape: TreeShape, cost: TreeCost | None, serves_trees: bool = True) -> dict:
    """The evaluator's tree entry: the shape, SGLang's flags for it (none where no engine serves the draft's trees:
    served false), and its measured costs."""
    out = {"topk": shape.topk, "depth": shape.depth, "nodes": shape.size, "name": shape.name}
    out |= {"sglang": shape.sglang_flags()} if serves_trees or shape.topk == 1 else {"served": False}
    if cost is not None:
        out |= {"draft_round_ms": cost.draft_round_ms, "draft_prefill_ms": cost.draft_prefill_ms,
                "verify_ms": cost.verify_ms, "target_step_ms": cost.target_step_ms, "d": cost.d, "v": cost.v}
    return out
