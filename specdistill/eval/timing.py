"""Wall-clock timing of decoding calls: synchronised timers, the cost model's c and v, and summed throughput."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from specdistill.decoding import Drafter, Rollout, Sampler, TreeShape
from specdistill.decoding.kv import BatchKV, CacheMode, device_of
from specdistill.eval.batches import PromptBatch
from specdistill.eval.results import CostRatio


def sync(device: torch.device) -> None:
    """Wait for the accelerator's queued work (a no-op on the CPU), so a timer sees finished work only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Run:
    """One timed decoding call on one batch."""
    tokens: list[list[int]]        # per row, generated tokens
    seconds: float                 # wall time of the call (prefill included)
    rollout: Optional[Rollout] = None


def timed(device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), wall seconds), synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def median_ms(device, fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of `reps` timed calls of fn, after one untimed call."""
    fn()  # one untimed call
    times = []
    for _ in range(reps):
        times.append(timed(device, fn)[1])
    return 1000 * statistics.median(times)


@torch.no_grad()
def measure_cost(target_model, drafter: Drafter, batch: PromptBatch, gamma: int, sampler: Sampler,
                 reps: int = 7, cache: CacheMode = CacheMode()) -> CostRatio:
    """Time one target forward of 1 and of gamma+1 tokens per row (KV-cached, rolled back after each), and the
    drafter's propose(gamma) in the steady state, at the batch's context, on the caches `cache` makes. Medians of
    `reps` runs.

    The first propose() after start() is the prefill round: an EAGLE-3 head reads the whole prompt there, an LM draft
    its pending token. It is timed apart (draft_prefill_ms) and kept out of c: each timed propose follows a committed
    round (one verify forward, every draft rejected), as every later round of a generation does."""
    device = device_of(target_model)
    ids, mask = batch.input_ids, batch.attention_mask
    B = ids.shape[0]
    new_kv = cache.factory(ids.shape[1] + (reps + 2) * (gamma + 1))  # the prompt, and every round fed below
    kv = new_kv(target_model)
    hidden = {"output_hidden_states": True} if drafter.needs_hidden_states else {}
    prefill = kv.prefill(ids[:, :-1], mask[:, :-1], **hidden)
    target_hidden = getattr(prefill, "hidden_states", None)  # EAGLE-3 heads start from the target's features
    pending = ids[:, -1:]

    def target_step(width: int):
        kv.step(pending.expand(B, width))
        kv.commit(torch.zeros(B, width, dtype=torch.bool, device=device))  # roll back: keep nothing

    step_ms = median_ms(device, lambda: target_step(1), reps)
    verify_ms = median_ms(device, lambda: target_step(gamma + 1), reps)
    draft = propose_times(kv, drafter, ids, mask, target_hidden, gamma, sampler, reps, new_kv)
    draft_ms = draft.steady_ms / max(gamma, 1)
    return CostRatio(step_ms, verify_ms, draft_ms, draft_ms / step_ms, verify_ms / step_ms, int(mask.sum(1).max()),
                     draft_prefill_ms=draft.first_ms)


@dataclass
class ProposeTimes:
    first_ms: float   # the first propose() after start(): the prefill round
    steady_ms: float  # median propose() after a committed round


@torch.no_grad()
def propose_times(kv: BatchKV, drafter: Drafter, ids: torch.Tensor, mask: torch.Tensor, target_hidden,
                      gamma: int, sampler: Sampler, reps: int, new_kv=BatchKV) -> ProposeTimes:
    """Time drafter.propose() of a chain of gamma right after start() (once), then `reps` times after a committed
    round, past one untimed warm-up. Each round between: the target verifies [pending, drafts] on kv (rolled back
    after), and the drafter commits with every draft rejected, the target's argmax at the pending position as its next
    token."""
    device = device_of(kv.model)
    B = ids.shape[0]
    hidden = {"output_hidden_states": True} if drafter.needs_hidden_states else {}
    drafter.start(ids, mask, target_hidden=target_hidden, new_kv=new_kv)
    chain = TreeShape.chain(gamma)
    proposal, first = timed(device, lambda: drafter.propose(chain, sampler))
    pending = ids[:, -1]                                                     # (B,)
    none = torch.zeros(B, dtype=torch.long, device=device)
    going = torch.ones(B, dtype=torch.bool, device=device)
    times = []
    for i in range(reps + 1):
        drafts = proposal.tokens.to(device)                                  # (B, k)
        out = kv.step(torch.cat([pending[:, None], drafts], dim=1), **hidden)
        kv.commit(torch.zeros(B, drafts.shape[1] + 1, dtype=torch.bool, device=device))  # the target stays put
        pending = out.logits[:, 0].argmax(-1)                                # (B,)
        drafter.commit(none, pending, going, target_hidden=getattr(out, "hidden_states", None))
        proposal, t = timed(device, lambda: drafter.propose(chain, sampler))
        if i:  # the first steady round is a warm-up
            times.append(t)
    return ProposeTimes(1000 * first, 1000 * statistics.median(times))


class Throughput:
    """Summed tokens and seconds of one decoding method, and its per-token latencies."""

    def __init__(self):
        self.tokens = self.calls = self.rounds = 0
        self.seconds = self.prefill = self.decode = 0.0
        self.lat: list[float] = []
        self.lat_w: list[float] = []

    def add(self, run: Run) -> None:
        self.tokens += sum(map(len, run.tokens))
        self.seconds += run.seconds
        self.calls += 1
        r = run.rollout
        if r is None:
            return
        self.prefill += r.prefill_seconds
        self.decode += r.decode_seconds
        self.rounds += len(r.round_seconds)
        if r.rounds:  # speculative: round i gives each row its num_emitted tokens
            for rnd, t in zip(r.rounds, r.round_seconds):
                for n in rnd.num_emitted.tolist():
                    if n > 0:
                        self.lat.append(t / n)
                        self.lat_w.append(n)
        else:  # target-only: one token per active row per round
            lengths = r.num_new_tokens.tolist()
            for i, t in enumerate(r.round_seconds):
                rows = sum(1 for n in lengths if n > i)
                if rows:
                    self.lat.append(t)
                    self.lat_w.append(rows)

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan

    def decode_tokens_per_s(self) -> float:
        return self.tokens / self.decode if self.decode > 0 else math.nan


Runner = Callable[[PromptBatch], Run]  # one timed decoding method


def run_pass(batches: list[PromptBatch], runners: dict[str, Runner], desc: str, progress: bool) -> dict[str, list[Run]]:
    """Every runner on every batch; the order rotates per batch so machine-load drift hits all runners alike."""
    from tqdm.auto import tqdm

    names = list(runners)
    runs: dict[str, list[Run]] = {n: [] for n in names}
    for i, batch in enumerate(tqdm(batches, desc=desc, disable=not progress, dynamic_ncols=True)):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            runs[name].append(runners[name](batch))
    return runs
