"""The speculative evaluator: real speculative decoding (specdistill.decoding) against target-only decoding on the same
prompts, from summed counts, with wall-clock speedup, latency, a cost model and a built-in losslessness check.

Definitions (every ratio is a ratio of sums over all prompts, never a mean of per-prompt ratios):
  round              one target forward (verify [pending, d_1..d_K]); per row, a "row-round"
  mean_accept_len    tau = generated tokens / row-rounds (bonus/correction token included; prefill excluded)
  accept_rate_per_pos a_k = P(draft k accepted | drafts 1..k-1 accepted and k drafted): the same a_k as the
                     training-time simulated acceptance (specdistill.eval.simulated); tau = 1 + sum_k prod_{i<=k} a_i
                     when every round drafts gamma and no row stops mid-round (EOS / budget)
  reach_rate_per_pos P(draft k accepted | k drafted) = accepted_k / proposed_k (the Rollout's own ratio)
  alpha_per_pos      mean sum_x min(p, q) at drafted position k given its prefix was accepted (== a_k at temperature 0)
  tokens_per_s       generated tokens / wall seconds of the generate calls (prefill included, warm-up excluded);
                     decode_tokens_per_s excludes the prefill
  speedup            tokens_per_s / target_only_tokens_per_s, same prompts, same batches, runs interleaved per batch
  latency_ms         per-token latency: a round of t seconds that emits n tokens to a row gives each of them t / n;
                     percentiles are over all generated tokens (token-weighted); prefill (time to first round) apart
  cost               c = one draft token / one target forward (1 token per row, KV-cached), v = target forward of
                     gamma+1 tokens / of 1 token, both timed here on the first batch (medians)
  predicted_speedup  Leviathan et al. (2023): (1 - a^(g+1)) / ((1 - a)(g c + 1)) with a = overall alpha, g = mean
                     gamma; predicted_speedup_measured_tau = tau / (g c + v) adds the measured verify cost
  accept_by_output_position  per bucket of output position (eval.position_buckets; a round belongs to the bucket of
                     the output position where it starts): tau = tokens / row-rounds and accept_rate = accepted drafts
                     / proposed drafts within the bucket, each with a 95% bootstrap interval over the prompts that
                     reached it (from the per-prompt counts outputs.jsonl keeps)
  by_category        the same tau and a_k within each prompt category (MT-bench's eight), from per-prompt counts that
                     outputs.jsonl keeps (category, new_tokens, target_forwards, reached/accepted per draft position)
  oracle             eval.drafter=oracle replays the target's own greedy output, so tau = gamma+1 (but where a row ends)
                     at no draft cost: bound = (gamma+1) / v(gamma+1) is the speedup of a free, always-accepted draft,
                     and efficiency = speedup / bound the share of it the decoder keeps (its own overhead)
  greedy_mismatches  temperature 0 only: prompts whose speculative output differs from target-only output (should be 0;
                     a mismatch at a near-tie of the target's top-2 logits is floating-point noise, reported as such)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Union

import torch

from specdistill.config import DRAFTERS, EvalConfig
from specdistill.constraints import check_fields
from specdistill.decoding import (CacheMode, Drafter, DynamicGamma, FixedGamma, LMDrafter, NGramDrafter, Sampler,
                                  Strategy, check_draft_policy, speculative_generate, target_generate)
from specdistill.decoding.drafters import OracleDrafter
from specdistill.decoding.compiled import compile_stats
from specdistill.decoding.kv import device_of, max_positions
from specdistill.decoding.tree import TreeShape
from specdistill.drafts import draft_adapter
from specdistill.eval.batches import PromptBatch, make_batches
from specdistill.eval.hf_baseline import HF_MODES, hf_generate, hf_runners, hf_summary  # noqa: F401  (re-exported)
from specdistill.eval.metrics import (SpecCounts, category_summary, leviathan_speedup, output_position_summary,
                                     row_acceptance, row_bucket_counts, weighted_percentiles)
from specdistill.eval.results import CostRatio, EvalResult, OracleOverhead, SweepPoint  # noqa: F401  (re-exported)
from specdistill.eval.timing import Run, Runner, Throughput, measure_cost, run_pass, timed  # noqa: F401
from specdistill.eval import tree_cost, tree_search
from specdistill.output_positions import check_position_buckets, output_position_buckets
from specdistill.tokens import eos_ids, pad_id as pad_id_of


# ------------------------------------------------------------------------------------------------ inputs
def make_drafter(spec: Union[str, Drafter, torch.nn.Module], target_model, cfg: EvalConfig) -> tuple[Drafter, str]:
    """'ngram' | 'target' | 'oracle' | a Drafter | a draft causal LM -> (Drafter, its name for reports)."""
    if isinstance(spec, Drafter):
        return spec, type(spec).__name__
    if isinstance(spec, torch.nn.Module):
        adapter = draft_adapter(spec)
        return adapter.drafter(confidence=cfg.draft_confidence), adapter.kind
    if spec == "ngram":
        return NGramDrafter(max_ngram=cfg.ngram_max, min_ngram=cfg.ngram_min), "ngram"
    if spec == "target":
        return LMDrafter(target_model, confidence=cfg.draft_confidence), "target"
    if spec == "oracle":
        cache = CacheMode(static=cfg.static_cache, compile=cfg.compile)
        return OracleDrafter(target_model, cfg.max_new_tokens, cache=cache), "oracle"
    raise ValueError(f"unknown drafter {spec!r}: pass a draft model, a Drafter, or one of 'ngram', 'target', 'oracle' "
                     f"(eval.drafter is one of {DRAFTERS}; 'draft' needs a model)")


def check_eval_config(cfg: EvalConfig) -> None:
    check_fields(cfg, "eval")  # every range and choice its fields declare (specdistill/config.py)
    check_position_buckets(cfg.position_buckets)
    if cfg.dynamic_gamma and cfg.max_gamma < cfg.gamma:
        raise ValueError(f"eval.max_gamma={cfg.max_gamma} must be >= eval.gamma={cfg.gamma} with dynamic_gamma")
    check_draft_policy(cfg.draft_policy, "eval.draft_policy")
    if tree_shape(cfg) is not None and (cfg.dynamic_gamma or (cfg.draft_policy == "sample" and cfg.temperature > 0)):
        raise ValueError("eval.tree decodes token trees of top-k children: unset eval.dynamic_gamma and use "
                         "eval.draft_policy=greedy (or eval.tree.topk=0 for chains)")
    if cfg.compare_hf and cfg.temperature != 0:
        raise ValueError("eval.compare_hf compares outputs token for token: it needs eval.temperature=0")


def _check_tree_drafter(cfg: EvalConfig, drafter: Drafter) -> None:
    """eval.tree asks for trees this drafter can grow, before any prompt is decoded."""
    shape = tree_shape(cfg)
    if shape is None:
        return
    if not drafter.grows_trees:
        raise ValueError(f"eval.tree.topk={shape.topk}: {type(drafter).__name__} proposes one token per position, so "
                         "it cannot grow token trees; set eval.tree.topk=0 for chains")
    top = drafter.max_tree_depth
    if top is not None and shape.depth > top:
        raise ValueError(f"eval.tree.depth={shape.depth} exceeds the {top} draft positions this drafter proposes per "
                         f"round (a block drafter of block size {top + 1}): set eval.tree.depth <= {top}")


def _check_oracle(cfg: EvalConfig, drafter: Drafter) -> None:
    """The oracle's report compares its speedup with (gamma+1) / v(gamma+1): temperature 0 (where the greedy replay is
    what the target emits), a fixed gamma, and v measured."""
    if not isinstance(drafter, OracleDrafter):
        return
    if cfg.temperature != 0:
        raise ValueError(f"eval.drafter=oracle replays the target's greedy output, which sampling at "
                         f"eval.temperature={cfg.temperature} leaves after its first differing token: set "
                         "eval.temperature=0")
    if cfg.dynamic_gamma:
        raise ValueError("eval.drafter=oracle measures the decoder's overhead at one draft length against "
                         "v(gamma+1): unset eval.dynamic_gamma")
    if not cfg.measure_cost:
        raise ValueError("eval.drafter=oracle reports its speedup against (gamma+1) / v(gamma+1), which needs the "
                         "verify cost timed: set eval.measure_cost=true")


def tree_shape(cfg: EvalConfig) -> Optional[TreeShape]:
    """The token-tree shape eval.tree asks for; None: chains of eval.gamma (eval.tree.topk=0)."""
    t = cfg.tree
    if t.topk == 0:
        return None
    try:
        return TreeShape(t.topk, t.depth, t.nodes)
    except ValueError as e:
        raise ValueError(f"eval.tree: {e}") from None


@dataclass
class _Prompts:
    ids: list[list[int]]              # token ids per prompt
    source: str                       # the source's name for reports
    categories: list[Optional[str]]   # per prompt (MT-bench's categories; None where the source has none)


def _prompt_ids(prompts, tokenizer, target_model, cfg: EvalConfig, source: Optional[str]) -> _Prompts:
    """A PromptSet, message lists or token-id lists -> their token ids, source name and categories."""
    from specdistill.data.prompts import PromptSet, tokenize_prompts

    if prompts is None or len(prompts) == 0:
        raise ValueError("the prompt set is empty: pass at least one prompt (eval.num_prompts >= 1)")
    categories = [None] * len(prompts)
    if isinstance(prompts, PromptSet):
        source = source or prompts.source
        prompt_ids = prompts.ids
        categories = prompts.categories
    elif prompts and isinstance(prompts[0], (list, tuple)) and prompts[0] and isinstance(prompts[0][0], int):
        prompt_ids = [list(p) for p in prompts]
        source = source or "token ids"
    else:
        source = source or "messages"
        ps = tokenize_prompts(tokenizer, list(enumerate(prompts)), max_positions(target_model), cfg.max_new_tokens,
                              cfg.max_prompt_tokens)
        prompt_ids = ps.ids
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("empty prompt set or an empty prompt: every prompt needs at least one token")
    return _Prompts(prompt_ids, source, categories)


# ------------------------------------------------------------------------------------------------ decoding calls
@dataclass
class _Decoders:
    """The timed decoding calls of one evaluation: target-only and speculative with the same sampling settings, and
    one seed stream (each sampled call gets a fresh generator, seeded cfg.seed, cfg.seed + 1, ... in call order)."""
    target_model: torch.nn.Module
    drafter: Drafter
    cfg: EvalConfig
    eos: Optional[list[int]]
    pad_id: int
    device: torch.device
    serves_trees: bool = True  # engines decode the draft's token trees (drafts/: DraftAdapter.serves_trees)
    _seeds: Iterator[int] = field(init=False, repr=False)

    def __post_init__(self):
        self._seeds = iter(range(self.cfg.seed, self.cfg.seed + 10**6))

    def strategy(self) -> Strategy:
        """What each round proposes: eval.tree's shape, or chains of eval.gamma (fixed or dynamic)."""
        cfg = self.cfg
        if tree_shape(cfg) is not None:
            return tree_shape(cfg)
        if cfg.dynamic_gamma:
            return DynamicGamma(min_gamma=1, max_gamma=cfg.max_gamma, init=cfg.gamma)
        return FixedGamma(cfg.gamma)

    def generator(self) -> Optional[torch.Generator]:
        if self.cfg.temperature == 0:
            return None
        return torch.Generator(device=self.device).manual_seed(next(self._seeds))

    def target(self, max_new: int) -> Runner:
        def run(b: PromptBatch) -> Run:
            r, t = timed(self.device, lambda: target_generate(
                self.target_model, b.input_ids, b.attention_mask, max_new_tokens=max_new, generator=self.generator(),
                cache=self.cache(), **self._sampling()))
            return Run([r.tokens(i) for i in range(len(b.index))], t, r)
        return run

    def spec(self, max_new: int, strategy: Strategy, score_nodes: bool = False) -> Runner:
        """Speculative decoding with `strategy` (chains or a tree shape); score_nodes: trees keep node_prob."""
        def run(b: PromptBatch) -> Run:
            r, t = timed(self.device, lambda: speculative_generate(
                self.target_model, self.drafter, b.input_ids, b.attention_mask, strategy=strategy,
                max_new_tokens=max_new, generator=self.generator(), draft_policy=self.cfg.draft_policy,
                cache=self.cache(), score_nodes=score_nodes, **self._sampling()))
            return Run([r.tokens(i) for i in range(len(b.index))], t, r)
        return run

    def pair(self, max_new: int, strategy: Strategy | None = None) -> dict[str, Runner]:
        """Target-only and speculative, in that order (run_pass rotates from it)."""
        strategy = strategy if strategy is not None else self.strategy()
        return {"target": self.target(max_new), "spec": self.spec(max_new, strategy)}

    def batches(self, prompt_ids: list[list[int]], batch_size: int) -> list[PromptBatch]:
        """Left-padded batches, each prepared by the drafter before any timed call (the oracle decodes it here)."""
        batches = make_batches(prompt_ids, batch_size, self.pad_id, self.device)
        for b in batches:
            self.drafter.prepare(b.input_ids, b.attention_mask)
        return batches

    def _sampling(self) -> dict:
        return dict(temperature=self.cfg.temperature, top_p=self.cfg.top_p, eos_token_id=self.eos)

    def cache(self) -> CacheMode:
        return CacheMode(static=self.cfg.static_cache, compile=self.cfg.compile)


@dataclass
class _Totals:
    """One pass's sums: speculative and target-only throughput, and the speculative acceptance counts."""
    spec: Throughput
    target: Throughput
    counts: SpecCounts

    def speedup(self) -> float:
        return self.spec.tokens_per_s() / self.target.tokens_per_s()

    def point(self, batch_size: int, num_prompts: int, mismatches: Optional[int]) -> SweepPoint:
        return SweepPoint(batch_size, num_prompts, self.spec.tokens_per_s(), self.target.tokens_per_s(),
                          self.speedup(), self.counts.tau(), mismatches)


def _totals(runs: dict[str, list[Run]], max_gamma: int) -> _Totals:
    out = _Totals(Throughput(), Throughput(), SpecCounts(max_gamma))
    for run in runs["spec"]:
        out.spec.add(run)
        out.counts.add(run.rollout)
    for run in runs["target"]:
        out.target.add(run)
    return out


# ------------------------------------------------------------------------------------------------ the steps
def _warm_up(dec: _Decoders, prompt_ids: list[list[int]], hf_warm: dict[str, Runner]) -> None:
    """Every code path once, on the first prompts, with a short budget (not counted)."""
    cfg = dec.cfg
    if cfg.warmup_prompts <= 0:
        return
    warm = dec.batches(prompt_ids[: cfg.warmup_prompts], cfg.batch_size)[:1]
    runners = dec.pair(min(cfg.max_new_tokens, 16))
    if hf_warm:
        run_pass(dec.batches(prompt_ids[:1], 1), hf_warm, "warm-up hf", False)
    run_pass(warm, runners, "warm-up", False)


def _tree_cost(dec: _Decoders, batch: PromptBatch) -> Optional[tree_cost.TreeCost]:
    """A token tree's draft cost per round and verify cost, timed on the first batch (None for chains)."""
    shape = tree_shape(dec.cfg)
    if shape is None or not dec.cfg.measure_cost:
        return None
    return tree_cost.measure_tree_cost(dec.target_model, dec.drafter, batch, shape, cache=dec.cache())


def _cost(dec: _Decoders, batch: PromptBatch, tree: Optional[tree_cost.TreeCost]) -> Optional[CostRatio]:
    """The cost model's c and v, timed on the first batch (None when switched off or without drafts). A tree's c is
    its draft cost per round over its depth (so gamma c is the round's), v its verify forward's."""
    cfg = dec.cfg
    if tree is not None:
        depth = tree_shape(cfg).max_depth
        return CostRatio(tree.target_step_ms, tree.verify_ms, tree.draft_round_ms / depth, tree.d / depth, tree.v,
                         int(batch.attention_mask.sum(1).max()), draft_prefill_ms=tree.draft_prefill_ms)
    if not cfg.measure_cost or cfg.gamma <= 0:
        return None
    return measure_cost(dec.target_model, dec.drafter, batch, cfg.gamma,
                        Sampler(cfg.temperature, cfg.top_p, dec.generator()).for_drafts(cfg.draft_policy),
                        cache=dec.cache())


def _mismatch(target_model, batch: PromptBatch, row: int, ours: list[int], ref: list[int], index: int) -> dict:
    """Where speculative and target-only outputs part, and the target's top-2 logit margin there (near 0 = a tie
    that floating-point differences between a 1-token and a (K+1)-token forward can flip)."""
    j = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    prompt = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
    with torch.no_grad():
        logits = target_model(input_ids=torch.tensor([prompt + ref[:j]], device=batch.input_ids.device)).logits[0, -1]
    top2 = logits.float().topk(2).values
    return {"prompt": index, "position": j, "spec_token": ours[j] if j < len(ours) else None,
            "target_token": ref[j] if j < len(ref) else None, "top2_logit_margin": (top2[0] - top2[1]).item(),
            "spec_len": len(ours), "target_len": len(ref)}


def _greedy_mismatches(target_model, batches: list[PromptBatch], runs: dict[str, list[Run]],
                       log: Callable[[str], None]) -> list[dict]:
    """Prompts whose speculative output differs from the target-only one (temperature 0), each logged."""
    mismatches = []
    for b, rs, rt in zip(batches, runs["spec"], runs["target"]):
        for row, (ours, ref) in enumerate(zip(rs.tokens, rt.tokens)):
            if ours != ref:
                mismatches.append(_mismatch(target_model, b, row, ours, ref, b.index[row]))
    for m in mismatches:
        log(f"[eval] greedy mismatch: prompt {m['prompt']} parts from target-only decoding at token "
            f"{m['position']} (target top-2 logit margin there {m['top2_logit_margin']:.2e})")
    return mismatches


def _samples(tokenizer, batches: list[PromptBatch], runs: dict[str, list[Run]], categories: list[Optional[str]],
             max_gamma: int, position_buckets: list[int]) -> list[dict]:
    """Per prompt: its category, decoded speculative output and counts, per draft position and per bucket of output
    position too (outputs.jsonl)."""
    samples = []
    for b, rs, rt in zip(batches, runs["spec"], runs["target"]):
        rows = row_acceptance(rs.rollout, max_gamma) if rs.rollout is not None else None
        buckets = output_position_buckets(rs.rollout.rounds, position_buckets) if rs.rollout is not None else None
        for row, i in enumerate(b.index):
            samples.append({"prompt": i, "category": categories[i], "prompt_tokens": int(b.attention_mask[row].sum()),
                            "new_tokens": len(rs.tokens[row]),
                            "target_forwards": 0 if rs.rollout is None else int(rs.rollout.target_forwards[row]),
                            "reached_per_pos": [] if rows is None else rows.reached[row].tolist(),
                            "accepted_per_pos": [] if rows is None else rows.accepted[row].tolist(),
                            "output_buckets": {} if buckets is None else row_bucket_counts(buckets, row),
                            "identical": rs.tokens[row] == rt.tokens[row],
                            "text": tokenizer.decode(rs.tokens[row], skip_special_tokens=False)})
    return samples


def _hf_side_by_side(dec: _Decoders, prompt_ids: list[list[int]], runs: dict[str, list[Run]],
                     hf: dict[str, Runner], drafter_name: str, progress: bool) -> dict:
    """HF at batch 1 next to ours: the measured pass's own runs when it ran at batch 1 (HF inline), else a batch-1
    pass of ours and HF's."""
    if dec.cfg.batch_size != 1:
        runs = run_pass(dec.batches(prompt_ids, 1), {"spec": dec.spec(dec.cfg.max_new_tokens, dec.strategy()),
                                                     "target": dec.target(dec.cfg.max_new_tokens), **hf},
                        "hf side by side", progress)
    return hf_summary(runs["spec"], runs["target"], {k: runs[k] for k in hf}, drafter_name)


def _row_mismatches(runs: dict[str, list[Run]]) -> int:
    return sum(a != b for rs, rt in zip(runs["spec"], runs["target"]) for a, b in zip(rs.tokens, rt.tokens))


def _batch_sweep(dec: _Decoders, prompt_ids: list[list[int]], main_point: SweepPoint,
                 progress: bool) -> list[SweepPoint]:
    """Speedup and tau per batch size, every point on the same first sweep_prompts prompts."""
    cfg = dec.cfg
    greedy = cfg.temperature == 0
    n_sweep = min(cfg.sweep_prompts, len(prompt_ids))
    sizes = sorted(set(cfg.batch_sizes))
    sweep = []
    for bs in sizes:
        # The main pass is the point at its own batch size when the sweep would only repeat it on fewer prompts.
        if bs == cfg.batch_size and (n_sweep == len(prompt_ids) or sizes == [bs]):
            sweep.append(main_point)
            continue
        runs = run_pass(dec.batches(prompt_ids[:n_sweep], bs), dec.pair(cfg.max_new_tokens), f"sweep B={bs}", progress)
        tot = _totals(runs, dec.strategy().max_shape.max_depth)
        sweep.append(tot.point(bs, n_sweep, _row_mismatches(runs) if greedy else None))
    return sweep


def _loadavg() -> Optional[float]:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _environment(dec: _Decoders, load_before: Optional[float]) -> dict:
    model = dec.target_model
    env = {"device": str(dec.device), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "dtype": str(next(model.parameters()).dtype), "loadavg_before": load_before, "loadavg_after": _loadavg(),
           "eos_token_ids": dec.eos, "cpu_count": os.cpu_count(), "warmup_prompts": dec.cfg.warmup_prompts,
           "target_params": sum(p.numel() for p in model.parameters())}
    if isinstance(dec.drafter, LMDrafter):
        env["draft_params"] = sum(p.numel() for p in dec.drafter.model.parameters())
    if dec.cfg.compile:  # compiles per graph of the compiled decode steps (each should be 1: decoding.CompileStats)
        env["compile_stats"] = {"target": compile_stats(model).as_dict()}
        draft = getattr(dec.drafter, "model", getattr(dec.drafter, "head", None))  # an LM draft's model, a head
        if draft is not None:
            env["compile_stats"]["draft"] = compile_stats(draft).as_dict()
    return env


def _assemble(cfg: EvalConfig, drafter_name: str, source: str, num_prompts: int, tot: _Totals,
              cost: Optional[CostRatio], mismatches: list[dict], sweep: list[SweepPoint], hf: Optional[dict],
              env: dict, samples: list[dict]) -> EvalResult:
    spec_t, target_t, counts = tot.spec, tot.target, tot.counts
    greedy = cfg.temperature == 0
    g = counts.mean_gamma()
    alpha = counts.alpha()
    pred_tau = pred = pred_measured = None
    if cost is not None and g > 0:
        pred_tau, pred = leviathan_speedup(alpha, g, cost.c)
        pred_measured = counts.tau() / (g * cost.c + cost.v)
    spec_round = spec_t.decode / max(spec_t.rounds, 1)
    target_round = target_t.decode / max(target_t.rounds, 1)
    return EvalResult(
        drafter=drafter_name, gamma=cfg.gamma, dynamic_gamma=cfg.dynamic_gamma, mean_gamma=g,
        temperature=cfg.temperature, top_p=cfg.top_p, draft_policy=cfg.draft_policy, prompts=source or cfg.prompts,
        num_prompts=num_prompts,
        batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens, new_tokens=spec_t.tokens,
        target_only_new_tokens=target_t.tokens, target_forwards=counts.forwards,
        mean_accept_len=counts.tau(), accept_rate_per_pos=counts.accept_rate_per_pos(),
        reach_rate_per_pos=counts.reach_rate_per_pos(), proposed_per_pos=counts.proposed.tolist(), alpha=alpha,
        alpha_per_pos=counts.alpha_per_pos(),
        accept_len_hist=counts.hist.tolist(),
        accept_by_output_position=output_position_summary(samples, cfg.position_buckets),
        position_buckets=list(cfg.position_buckets),
        tokens_per_s=spec_t.tokens_per_s(), target_only_tokens_per_s=target_t.tokens_per_s(),
        speedup=tot.speedup(),
        decode_tokens_per_s=spec_t.decode_tokens_per_s(),
        target_only_decode_tokens_per_s=target_t.decode_tokens_per_s(),
        decode_speedup=spec_t.decode_tokens_per_s() / target_t.decode_tokens_per_s(),
        seconds=spec_t.seconds, target_only_seconds=target_t.seconds,
        prefill_ms_mean=1000 * spec_t.prefill / max(spec_t.calls, 1),
        target_only_prefill_ms_mean=1000 * target_t.prefill / max(target_t.calls, 1),
        latency_ms=weighted_percentiles(spec_t.lat, spec_t.lat_w),
        target_only_latency_ms=weighted_percentiles(target_t.lat, target_t.lat_w),
        round_cost_ratio=spec_round / target_round if target_round > 0 else math.nan,
        cost=cost, predicted_tau_from_alpha=pred_tau, predicted_speedup=pred,
        predicted_speedup_measured_tau=pred_measured,
        greedy_mismatches=len(mismatches) if greedy else None, mismatches=mismatches,
        by_category=category_summary(samples), batch_sweep=sweep, hf=hf, env=env, samples=samples)


# ------------------------------------------------------------------------------------------------ the evaluator
def evaluate(target_model, tokenizer, drafter_spec, prompts, cfg: EvalConfig, *, progress: bool = True,
             log: Callable[[str], None] = print, source: Optional[str] = None) -> EvalResult:
    """Speculative decoding vs target-only decoding of `target_model` on `prompts`.

    drafter_spec: a draft causal LM, a spec.Drafter, 'ngram', 'target' (the target drafting for itself) or 'oracle'
    (the target's greedy output replayed: the decoder's own overhead).
    prompts: a PromptSet (specdistill.data.prompts), a list of message lists, or a list of token-id lists.
    """
    check_eval_config(cfg)
    target_model.eval()
    ps = _prompt_ids(prompts, tokenizer, target_model, cfg, source)
    prompt_ids, source = ps.ids, ps.source
    drafter, drafter_name = make_drafter(drafter_spec, target_model, cfg)
    _check_tree_drafter(cfg, drafter)
    _check_oracle(cfg, drafter)
    eos = eos_ids(tokenizer, target_model, cfg.ignore_eos)
    serves_trees = draft_adapter(drafter_spec).serves_trees if isinstance(drafter_spec, torch.nn.Module) else True
    dec = _Decoders(target_model, drafter, cfg, eos, pad_id_of(tokenizer, eos), device_of(target_model), serves_trees)
    load_before = _loadavg()
    hf, hf_warm = {}, {}
    if cfg.compare_hf:
        hf = hf_runners(target_model, drafter, drafter_name, cfg, eos, dec.pad_id, cfg.max_new_tokens)
        hf_warm = hf_runners(target_model, drafter, drafter_name, cfg, eos, dec.pad_id, min(cfg.max_new_tokens, 16))

    # 1. Warm-up (not counted); 2. the cost model's c and v on the first batch.
    _warm_up(dec, prompt_ids, hf_warm)
    batches = dec.batches(prompt_ids, cfg.batch_size)
    tcost = _tree_cost(dec, batches[0])
    cost = _cost(dec, batches[0], tcost)

    # 3. The measured pass: target-only and speculative (and HF at batch 1) interleaved per batch.
    strategy = dec.strategy()
    max_depth = strategy.max_shape.max_depth  # the counters' width: draft positions, a tree's depths
    hf_inline = bool(hf) and cfg.batch_size == 1
    runners = dec.pair(cfg.max_new_tokens, strategy) | (hf if hf_inline else {})
    runs = run_pass(batches, runners, f"eval {drafter_name} gamma={cfg.gamma} B={cfg.batch_size}", progress)
    tot = _totals(runs, max_depth)
    greedy = cfg.temperature == 0
    mismatches = _greedy_mismatches(target_model, batches, runs, log) if greedy else []
    samples = _samples(tokenizer, batches, runs, ps.categories, max_depth, cfg.position_buckets)

    # 4. HF side by side at batch 1; 5. the batch-size sweep; 6. assemble.
    hf_result = _hf_side_by_side(dec, prompt_ids, runs, hf, drafter_name, progress) if hf else None
    main_point = tot.point(cfg.batch_size, len(prompt_ids), len(mismatches) if greedy else None)
    sweep = _batch_sweep(dec, prompt_ids, main_point, progress)
    result = _assemble(cfg, drafter_name, source, len(prompt_ids), tot, cost, mismatches, sweep, hf_result,
                       _environment(dec, load_before), samples)
    if isinstance(drafter, OracleDrafter):  # the decoder's own overhead: speedup against (gamma+1) / v(gamma+1)
        # in place of the cost model, whose settings all accept everything here
        result.oracle = OracleOverhead.of(cfg.gamma, result.mean_accept_len, result.speedup, result.decode_speedup,
                                          cost)
        return result
    return _with_cost_model(dec, batches, prompt_ids, result, runs, tot, tcost, progress, log)


def _with_cost_model(dec: _Decoders, batches: list[PromptBatch], prompt_ids: list[list[int]], result: EvalResult,
                     runs: dict[str, list[Run]], tot: _Totals, tcost: Optional[tree_cost.TreeCost], progress: bool,
                     log: Callable[[str], None]) -> EvalResult:
    """Add the tree's report and the cost model: v(k) for k up to 32 and the predicted speedup of each setting that
    the measured acceptance predicts (every chain length up to gamma, or the tree as run), naming the best.
    eval.measure_recommended searches tree shapes too and decodes the prompts with the recommended setting
    (_recommend)."""
    shape = tree_shape(dec.cfg)
    if shape is not None:
        result.tree = tree_cost.tree_report(shape, tcost, dec.serves_trees)
    if result.cost is None:
        return result
    curve = tree_cost.verify_curve(dec.target_model, batches[0], cache=dec.cache())
    if dec.cfg.measure_recommended:
        result.cost_model = _recommend(dec, batches, prompt_ids, result, runs, tot, tcost, curve, progress, log)
        return result
    settings = (tree_cost.chain_settings(result.accept_rate_per_pos, result.cost.c, curve) if shape is None
                else [tree_cost.tree_setting(shape, result.mean_accept_len, tcost)])
    result.cost_model = tree_cost.cost_model_report(curve, settings, dec.serves_trees)
    return result


def _main_setting(cfg: EvalConfig) -> str:
    shape = tree_shape(cfg)
    return shape.name if shape is not None else f"chain{cfg.gamma}" + ("-dynamic" if cfg.dynamic_gamma else "")


def _recommend(dec: _Decoders, batches: list[PromptBatch], prompt_ids: list[list[int]], result: EvalResult,
               runs: dict[str, list[Run]], tot: _Totals, tcost: Optional[tree_cost.TreeCost],
               curve: tree_cost.VerifyCurve, progress: bool, log: Callable[[str], None]) -> dict:
    """eval.measure_recommended: every chain length up to gamma (a chain run) and, for drafts that score alternatives,
    every tree shape of topk 1..4, depth 1..eval.tree.search_depth and nodes + 1 <= 32 (tau by replay on a probe
    decode: eval/tree_search.py), each costed from this machine's measured draft, verify and per-round bookkeeping
    times; the best one is decoded on every prompt (one pass, against the measured pass's target-only runs; not
    again when it is the configured setting) and its measured speedup set beside the prediction."""
    cfg = dec.cfg
    step = curve.step_ms
    baseline = 1000 * tot.target.decode / max(tot.target.rounds, 1) / step   # target-only decoding, in target steps
    spec_round = 1000 * tot.spec.decode / max(tot.spec.rounds, 1) / step      # the measured pass's round
    notes: list[str] = []
    settings: list[tree_cost.Setting] = []
    main = tree_shape(cfg)
    if main is None:
        settings += _chain_candidates(dec, batches[0], prompt_ids, result, curve, spec_round, baseline, progress,
                                      notes)
    else:
        notes.append(f"chains: the measured pass decoded trees ({main.name}); trees of topk 1 are the chains")
    search = _tree_candidates(dec, prompt_ids, batches[0], curve, baseline, progress, notes)
    settings += search
    if not settings:
        settings = [tree_cost.tree_setting(main, result.mean_accept_len, tcost)]
    tokens = result.new_tokens / max(result.num_prompts, 1)  # per row: each row's last round is cut short
    for s in settings:
        s.tokens = tokens
    model = tree_cost.cost_model_report(curve, settings, dec.serves_trees)
    rec = tree_cost.best(settings, dec.serves_trees)
    main_name = _main_setting(cfg)
    model["baseline"] = baseline
    model["tokens_per_row"] = tokens
    model["notes"] = notes
    model["main"] = {"name": main_name, "speedup": result.speedup, "decode_speedup": result.decode_speedup,
                     "mean_accept_len": result.mean_accept_len, "mean_gamma": result.mean_gamma}
    same = rec.name == main_name or (main is not None and rec.shape == main)
    measured = dict(model["main"], name=rec.name, decoded=False)
    if not same:
        measured = _measure(dec, batches, runs, tot, rec, progress)
    measured["predicted_speedup"] = rec.predicted_speedup
    measured["ratio"] = measured["decode_speedup"] / rec.predicted_speedup
    measured["within_10pct"] = abs(measured["ratio"] - 1) <= 0.10
    measured["at_least_main"] = measured["speedup"] >= result.speedup  # overall speedups, prefill included
    model["measured"] = measured
    flags = " ".join(f"{k} {v}" for k, v in rec.flags.items())
    log(f"[eval] cost model: recommended {rec.name} ({flags}): predicted {rec.predicted_speedup:.3f}x, measured "
        f"{measured['decode_speedup']:.3f}x decode / {measured['speedup']:.3f}x overall (ratio {measured['ratio']:.2f}"
        f"{'' if measured['within_10pct'] else ', off by more than 10%'}); {main_name} measured {result.speedup:.3f}x"
        + ("; no setting is faster than the target alone on this machine" if measured["speedup"] < 1
           and rec.predicted_speedup < 1 else ""))
    return model


def _chain_candidates(dec: _Decoders, batch: PromptBatch, prompt_ids: list[list[int]], result: EvalResult,
                      curve: tree_cost.VerifyCurve, spec_round: float, baseline: float, progress: bool,
                      notes: list[str]) -> list[tree_cost.Setting]:
    """Chain lengths 1 .. gamma: tau from the measured a_k; a round's draft cost on the line through propose(1) and
    propose(gamma), both timed (linear in the length for a draft that drafts token by token, flat for a block
    drafter); the bookkeeping o(g) on the line through two decodes: the measured pass's round (g = gamma) and a probe
    decode of chain 1 on the first eval.tree.probe_prompts prompts (g = 1), each beyond its draft and verify
    forwards. Drafting a token costs more inside a round than alone (sampling, the head's feature bookkeeping), so a
    constant o, fitted at gamma, overcharges short chains."""
    cfg = dec.cfg
    gamma = max(1, round(result.mean_gamma)) if cfg.dynamic_gamma else cfg.gamma
    step = curve.step_ms
    d_gamma = result.cost.draft_token_ms * cfg.gamma / step
    d_one = d_gamma if cfg.gamma == 1 else _cost_at(dec, batch, 1).draft_token_ms / step
    draft = tree_cost.linear(1, d_one, cfg.gamma, d_gamma)
    o_gamma = max(0.0, spec_round - draft(gamma) - curve.v(min(gamma + 1, len(curve.ms))))
    overhead = tree_cost.linear(1, o_gamma, gamma, o_gamma)
    if gamma > 1 and cfg.tree.probe_prompts > 0:
        once = replace(dec, cfg=replace(cfg, gamma=1, dynamic_gamma=False, tree=replace(cfg.tree, topk=0)))
        probe = dec.batches(prompt_ids[: cfg.tree.probe_prompts], cfg.batch_size)
        runs = run_pass(probe, {"probe": once.spec(cfg.max_new_tokens, FixedGamma(1))}, "probe chain1", progress)
        seconds = [t for run in runs["probe"] for t in run.rollout.round_seconds]
        round_one = 1000 * sum(seconds) / max(len(seconds), 1) / step
        o_one = max(0.0, round_one - draft(1) - curve.v(2))
        overhead = tree_cost.linear(1, o_one, gamma, o_gamma)
        notes.append(f"chains: bookkeeping per round {o_one:.3f} target steps at chain 1 (probe of "
                     f"{min(cfg.tree.probe_prompts, len(prompt_ids))} prompts, {len(seconds)} row-rounds) and "
                     f"{o_gamma:.3f} at chain {gamma} (the measured pass), linear between")
    return tree_cost.chain_settings(result.accept_rate_per_pos, result.cost.c, curve, draft, overhead, baseline)


def _cost_at(dec: _Decoders, batch: PromptBatch, gamma: int) -> CostRatio:
    cfg = dec.cfg
    return measure_cost(dec.target_model, dec.drafter, batch, gamma,
                        Sampler(cfg.temperature, cfg.top_p, dec.generator()).for_drafts(cfg.draft_policy),
                        cache=dec.cache())


def _tree_candidates(dec: _Decoders, prompt_ids: list[list[int]], batch: PromptBatch, curve: tree_cost.VerifyCurve,
                     baseline: float, progress: bool, notes: list[str]) -> list[tree_cost.Setting]:
    """Tree shapes from a probe decode (eval/tree_search.py), or none, with the reason in `notes`."""
    cfg = dec.cfg
    if not dec.drafter.grows_trees:
        notes.append(f"trees not searched: {type(dec.drafter).__name__} cannot score alternatives (it drafts one "
                     "token per position), so the recommended setting is a chain length")
        return []
    if cfg.temperature > 0 and cfg.draft_policy == "sample":
        notes.append("trees not searched: eval.draft_policy=sample draws chains; trees propose top-k children "
                     "(eval.draft_policy=greedy)")
        return []
    if cfg.tree.probe_prompts == 0:
        notes.append("trees not searched: eval.tree.probe_prompts=0")
        return []
    D = cfg.tree.search_depth
    if dec.drafter.max_tree_depth is not None:
        D = min(D, dec.drafter.max_tree_depth)
        notes.append(f"trees searched to depth {D}: the drafter proposes at most {dec.drafter.max_tree_depth} "
                     "positions per round")
    # 1. Each topk's draft cost per round at depth 1 and D (these also warm the tree code up for the probe).
    ends = {}
    for k in range(1, tree_search.MAX_TOPK + 1):
        for d in sorted({1, D}):
            ends[k, d] = tree_cost.measure_tree_cost(dec.target_model, dec.drafter, batch, TreeShape(k, d),
                                                     cache=dec.cache())
    # 2. The probe decode: its trees (tau by replay) and its rounds' wall time (the bookkeeping o).
    probe = TreeShape(tree_search.MAX_TOPK, D)
    probe_batches = dec.batches(prompt_ids[: cfg.tree.probe_prompts], cfg.batch_size)
    runs = run_pass(probe_batches, {"probe": dec.spec(cfg.max_new_tokens, probe, score_nodes=True)},
                    f"probe {probe.name}", progress)
    rounds = [r for run in runs["probe"] for r in run.rollout.rounds]
    trees = tree_search.probe_trees(probe, rounds)
    if trees is None:
        notes.append(f"trees not searched: every round of the probe {probe.name} was cut short by "
                     f"eval.max_new_tokens={cfg.max_new_tokens} (raise it above eval.tree.search_depth={D})")
        return []
    step = curve.step_ms
    lines = {k: tree_cost.linear(1, ends[k, 1].draft_round_ms / step, D, ends[k, D].draft_round_ms / step)
             for k in range(1, tree_search.MAX_TOPK + 1)}
    probe_round = 1000 * sum(sum(run.rollout.round_seconds) for run in runs["probe"]) / max(
        sum(len(run.rollout.round_seconds) for run in runs["probe"]), 1) / step
    top = ends[tree_search.MAX_TOPK, D]
    overhead = max(0.0, probe_round - lines[tree_search.MAX_TOPK](D) - top.verify_ms / step)
    notes.append(f"trees searched: probe {probe.name} on {len(probe_batches)} batch(es) of the first "
                 f"{min(cfg.tree.probe_prompts, len(prompt_ids))} prompts, {trees.rounds} row-rounds; a tree's "
                 f"draft cost on the line through depth 1 and {D} (timed per topk), its bookkeeping o from the "
                 "probe's rounds")
    return tree_search.tree_settings(trees, lambda k, d: lines[k](d), curve, overhead, baseline)


def _measure(dec: _Decoders, batches: list[PromptBatch], runs: dict[str, list[Run]], tot: _Totals,
             rec: tree_cost.Setting, progress: bool) -> dict:
    """Decode every prompt with the recommended setting (speculative only: the measured pass's target-only runs are
    the baseline and the greedy reference)."""
    cfg = dec.cfg
    if rec.shape is not None:
        runner, max_gamma = dec.spec(cfg.max_new_tokens, rec.shape), rec.shape.max_depth
    else:
        again = replace(dec, cfg=replace(cfg, gamma=rec.gamma, dynamic_gamma=False, tree=replace(cfg.tree, topk=0)))
        runner, max_gamma = again.spec(cfg.max_new_tokens, FixedGamma(rec.gamma)), rec.gamma
    spec_runs = run_pass(batches, {"spec": runner}, f"eval recommended {rec.name}", progress)["spec"]
    spec, counts = Throughput(), SpecCounts(max_gamma)
    for run in spec_runs:
        spec.add(run)
        counts.add(run.rollout)
    out = {"name": rec.name, "decoded": True, "speedup": spec.tokens_per_s() / tot.target.tokens_per_s(),
           "decode_speedup": spec.decode_tokens_per_s() / tot.target.decode_tokens_per_s(),
           "mean_accept_len": counts.tau(), "mean_gamma": counts.mean_gamma(), "tokens_per_s": spec.tokens_per_s(),
           "accept_rate_per_pos": counts.accept_rate_per_pos()}
    if cfg.temperature == 0:
        out["greedy_mismatches"] = sum(a != b for rs, rt in zip(spec_runs, runs["target"])
                                       for a, b in zip(rs.tokens, rt.tokens))
    return out


def for_training(cfg: EvalConfig) -> EvalConfig:
    """The in-training variant: no sweep, no HF comparison, no extra passes."""
    return replace(cfg, batch_sizes=[cfg.batch_size], compare_hf=False, sweep_prompts=cfg.num_prompts or 1)
