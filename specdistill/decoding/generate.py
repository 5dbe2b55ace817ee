"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) and its target-only baseline, each giving a Rollout.

Each round: the drafter proposes K tokens, the target scores [pending, d_1..d_K] in ONE forward, verification keeps
an accepted prefix plus one target token (correction or bonus), and both caches roll back to what was kept.
Both models' states hold every token but the last ("pending") one, so the prefill feeds prompt[:, :-1] and every
generated token comes out of a round: target forwards = rounds, and mean_accept_len = tokens / rounds.
Batch > 1: one shared cache per model with per-row masks and positions (see kv.py); rows accept different counts,
and a row that hit EOS or max_new_tokens stops counting (its later compute is wasted, never emitted).
cache=CacheMode(static=True) preallocates both models' caches to the call's longest possible length (compile=True also
runs their decode forwards as graphs compiled once per batch bucket and step width: compiled.py, compile_stats): the
same tokens as the growing caches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdistill.tokens import check_vocab_compatible, pad_id

from .drafters import Drafter
from .kv import CacheMode, TokenBuffer, device_of, logits_dim, max_positions
from .sampling import DEFAULT_DRAFT_POLICY, Sampler
from .verify import verify_greedy, verify_sampling


# ----------------------------------------------------------------------------------------------- gamma policies
class GammaPolicy(Protocol):
    max_gamma: int

    def gamma(self) -> int: ...

    def update(self, proposed: int, accepted: int) -> None: ...


@dataclass
class FixedGamma:
    k: int

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"gamma must be >= 0, got {self.k}")

    @property
    def max_gamma(self) -> int:
        return self.k

    def gamma(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        pass


@dataclass
class DynamicGamma:
    """Adapts gamma to the recent acceptance rate: an EMA of accepted / proposed drafts per round (summed over
    rows). Above grow_above (rounds where everything is accepted push it there) gamma grows by 1, below
    shrink_below it shrinks by 1, always within [min_gamma, max_gamma]. State persists across calls."""

    min_gamma: int = 1
    max_gamma: int = 8
    init: int = 4
    smoothing: float = 0.5  # weight of the past in the EMA
    grow_above: float = 0.8
    shrink_below: float = 0.4
    ema: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_gamma <= self.init <= self.max_gamma:
            raise ValueError(f"need 1 <= min_gamma <= init <= max_gamma, got {self.min_gamma}, {self.init}, "
                             f"{self.max_gamma}")
        if not 0 <= self.smoothing < 1 or not 0 <= self.shrink_below < self.grow_above <= 1:
            raise ValueError("need 0 <= smoothing < 1 and 0 <= shrink_below < grow_above <= 1")
        self._gamma = self.init

    def gamma(self) -> int:
        return self._gamma

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        rate = accepted / proposed
        self.ema = rate if self.ema is None else self.smoothing * self.ema + (1 - self.smoothing) * rate
        if self.ema >= self.grow_above:
            self._gamma = min(self._gamma + 1, self.max_gamma)
        elif self.ema < self.shrink_below:
            self._gamma = max(self._gamma - 1, self.min_gamma)


# ----------------------------------------------------------------------------------------------- results
@dataclass
class RoundRecord:
    """One verification round = one target forward. Per-row tensors; a row inactive this round emits nothing."""

    gamma: int                   # K, tokens drafted this round
    active: torch.Tensor         # (B,) bool, rows still generating when the round began
    offset: torch.Tensor         # (B,) long, tokens the row had generated before this round (index into sequences)
    draft_tokens: torch.Tensor   # (B, K)
    accepted: torch.Tensor       # (B, K) bool
    num_accepted: torch.Tensor   # (B,)
    next_token: torch.Tensor     # (B,) correction or bonus (meaningless where not active)
    num_emitted: torch.Tensor    # (B,) tokens appended to sequences (num_accepted + 1, cut at EOS / budget)
    alpha: torch.Tensor          # (B, K) sum_x min(p, q) per drafted position, after a rejection too; 0 if inactive
    # record=True only: what an on-policy trainer builds its loss from (p after processing is
    # sampling.probs_from_logits(target_logits, temperature, top_p); q is the drafter's to recompute).
    target_logits: torch.Tensor | None = None  # (B, K+1, V) raw target logits at [pending, d_1..d_K]


@dataclass
class Rollout:
    sequences: torch.Tensor          # (B, max_new_tokens) generated tokens; pad_token after num_new_tokens
    num_new_tokens: torch.Tensor     # (B,)
    rounds: list[RoundRecord]        # empty for target_generate
    target_forwards: torch.Tensor    # (B,) rounds (decode forwards) in which the row was active; prefill excluded
    accept_hist: torch.Tensor        # (max_gamma+1,) row-rounds by num_accepted
    position_proposed: torch.Tensor  # (max_gamma,) drafts proposed at draft position k, summed over row-rounds
    position_accepted: torch.Tensor  # (max_gamma,) drafts accepted at position k
    position_alpha: torch.Tensor     # (max_gamma,) sum of alpha at position k
    prefill_seconds: float           # target prefill + drafter start (warm-up: report apart)
    round_seconds: list[float]       # wall time of each round (host-synchronized, CUDA included); target_generate
    #   with sync_every > 1: the steps between two syncs share that interval's time evenly
    # capture_layers=... only: the target's hidden states of every token it was fed and kept, the chosen layers
    # concatenated: columns 0..P-2 are the left-padded prompt but its last token, column P-1+i the i-th token after
    # them (the prompt's last token, then generated token i-1). So column c holds the features of token c of
    # [left-padded prompt, generated tokens]; the last generated token is never fed and has no column.
    # target_generate: one column per decode step (a stopped row's later columns are garbage, never emitted).
    # speculative_generate: the verify forwards' kept columns [pending, accepted drafts], written at their token's
    # column (columns past P-1+num_new_tokens-1 stay zero): features that serve EAGLE-3 training come free of the
    # decode, exactly as a fresh target forward over the tokens would give them (KV-cached, up to float rounding).
    hidden: torch.Tensor | None = None  # (B, P-1+steps, D) target_generate; (B, P-1+max_new_tokens, D) speculative

    @property
    def decode_seconds(self) -> float:
        return sum(self.round_seconds)

    @property
    def mean_accept_len(self) -> float:
        """Tokens per target forward (bonus included), from summed counts."""
        return self.num_new_tokens.sum().item() / max(self.target_forwards.sum().item(), 1)

    @property
    def acceptance_per_position(self) -> torch.Tensor:
        """P(draft k accepted) = P(drafts 0..k all accepted); accepted[k] / accepted[k-1] is the conditional rate."""
        return self.position_accepted / self.position_proposed.clamp(min=1)  # (max_gamma,)

    def tokens(self, row: int) -> list[int]:
        return self.sequences[row, : int(self.num_new_tokens[row])].tolist()


# ----------------------------------------------------------------------------------------------- helpers
def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _check_draft_vocab(target_model, drafter) -> None:
    """The drafter's output vocabulary must be the target's: verification compares distributions token by token."""
    if drafter.vocab_size is not None:
        check_vocab_compatible(drafter.vocab_size, logits_dim(target_model), "verification compares distributions "
                               "token by token; use a draft with the target's tokenizer and output vocab (or a "
                               "vocab-mapped head)")


def _check_inputs(model, input_ids, attention_mask, max_new_tokens, device):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    input_ids, attention_mask = input_ids.to(device).long(), attention_mask.to(device).long()
    lengths = attention_mask.sum(1)
    if input_ids.shape[1] == 0 or bool((lengths == 0).any()):
        raise ValueError("empty prompt: every row needs at least one real token (e.g. BOS or a chat template)")
    if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError("prompts must be left-padded (tokenizer padding_side='left'), real tokens last")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = max_positions(model)
    longest = int(lengths.max())
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                         f"max_position_embeddings={limit}: shorten the prompt or lower max_new_tokens")
    return input_ids, attention_mask


def _cache_length(input_ids: torch.Tensor, max_new_tokens: int, max_gamma: int) -> int:
    """Columns a static cache needs for one call: the left-padded prompt but its pending token, plus what a row keeps
    before its last round (< max_new_tokens), plus one round's max_gamma + 1 fed tokens; holes beyond that compact."""
    return input_ids.shape[1] - 1 + max_new_tokens + max_gamma + 1


def _eos(eos_token_id, device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def _emit_counts(tokens, num_emitted, generated, max_new_tokens, eos, active):
    """tokens (B, C): how many to append per row (cut after EOS and at the budget), and which rows are done."""
    count = torch.minimum(num_emitted, max_new_tokens - generated)          # (B,)
    if eos is not None:
        is_eos = torch.isin(tokens, eos) & (torch.arange(tokens.shape[1], device=tokens.device) < count[:, None])
        hit = is_eos.any(1)
        count = torch.where(hit, is_eos.long().argmax(1) + 1, count)       # keep the EOS itself
    else:
        hit = torch.zeros_like(active)
    count = count * active
    done = active & (hit | (generated + count >= max_new_tokens))
    return count, done


def _pad_id(eos_token_id) -> int:
    """What fills a row's sequence after it ended: tokens.pad_id's rule without a tokenizer (first eos id, else 0)."""
    eos = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    return pad_id(None, None if eos is None else list(eos))


def _layers(out, layers: list[int]) -> torch.Tensor:
    """A forward's hidden states of the chosen HF hidden_states ids, concatenated: (B, C, sum of widths)."""
    return torch.cat([out.hidden_states[k] for k in layers], dim=-1)


class _KeptFeatures:
    """speculative_generate(capture_layers=...): Rollout.hidden, filled from the prefill and the verify forwards."""

    def __init__(self, layers: list[int], prefill, B: int, T: int, max_new_tokens: int, device):
        self.layers, self.start = layers, T - 1
        first = None if prefill is None else _layers(prefill, layers)       # (B, T-1, D)
        self.data: torch.Tensor | None = None
        self.width = self.start + max_new_tokens                            # + 1 trash column for unkept slots
        if first is not None:
            self._make(first)
            self.data[:, : self.start] = first

    def _make(self, like: torch.Tensor) -> None:
        self.data = like.new_zeros(like.shape[0], self.width + 1, like.shape[-1])

    def add(self, out, offset: torch.Tensor, count: torch.Tensor) -> None:
        """out: the verify forward over [pending, d_1..d_K]; row b keeps its first count[b] columns (the tokens at
        offset[b] .. offset[b]+count[b]-1 after the prompt but its last token: pending, then the accepted drafts)."""
        feats = _layers(out, self.layers)                                   # (B, K+1, D)
        if self.data is None:
            self._make(feats)
        j = torch.arange(feats.shape[1], device=feats.device)
        col = torch.where(j < count[:, None], self.start + offset[:, None] + j, self.width)  # (B, K+1)
        self.data.scatter_(1, col[..., None].expand(-1, -1, feats.shape[-1]), feats.to(self.data.dtype))

    def result(self) -> torch.Tensor:
        return self.data[:, : self.width]


def _counters(batch: int, max_gamma: int, device) -> dict[str, torch.Tensor]:
    return dict(
        target_forwards=torch.zeros(batch, dtype=torch.long, device=device),
        accept_hist=torch.zeros(max_gamma + 1, dtype=torch.long, device=device),
        position_proposed=torch.zeros(max_gamma, dtype=torch.long, device=device),
        position_accepted=torch.zeros(max_gamma, dtype=torch.long, device=device),
        position_alpha=torch.zeros(max_gamma, dtype=torch.float, device=device),
    )


# ----------------------------------------------------------------------------------------------- decoding
@torch.no_grad()
def speculative_generate(
    target_model: torch.nn.Module,
    drafter: Drafter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    gamma: int | GammaPolicy = 4,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    record: bool = False,
    draft_policy: str = DEFAULT_DRAFT_POLICY,
    capture_layers: list[int] | None = None,
    cache: CacheMode = CacheMode(),
) -> Rollout:
    """Generate from target_model with drafts from `drafter`; lossless: greedy output equals target-only greedy,
    sampled output is distributed as the target's (same temperature / top_p processing for both models).

    draft_policy (sampling.DRAFT_POLICIES, temperature > 0 only): "greedy" drafts q's argmax and verifies it as a
    one-hot proposal (the serving engines' way), "sample" draws drafts from q and verifies with q.
    capture_layers: HF hidden_states ids whose features of every kept token come back in Rollout.hidden (on-policy
    training of EAGLE-3 heads reads them instead of running the target again).
    cache: growing (default) or static KV caches, compiled or not (kv.CacheMode), for the target and LM drafts."""
    policy = FixedGamma(gamma) if isinstance(gamma, int) else gamma
    sampler = Sampler(temperature, top_p, generator)
    draft_sampler = sampler.for_drafts(draft_policy)
    device = device_of(target_model)
    input_ids, attention_mask = _check_inputs(target_model, input_ids, attention_mask, max_new_tokens, device)
    _check_draft_vocab(target_model, drafter)
    B = input_ids.shape[0]
    eos = _eos(eos_token_id, device)
    hidden = {"output_hidden_states": True} if drafter.needs_hidden_states or capture_layers else {}
    out = TokenBuffer(B, max_new_tokens, device, fill=_pad_id(eos_token_id))
    stats = _counters(B, policy.max_gamma, device)
    rounds: list[RoundRecord] = []
    round_seconds: list[float] = []

    # 1. Prefill both models with the prompt but its last token, which becomes the first pending token.
    t0 = _clock(device)
    new_kv = cache.factory(_cache_length(input_ids, max_new_tokens, policy.max_gamma))
    target = new_kv(target_model)
    try:
        prefill = target.prefill(input_ids[:, :-1], attention_mask[:, :-1], **hidden)
        drafter.start(input_ids, attention_mask, target_hidden=getattr(prefill, "hidden_states", None),
                      new_kv=new_kv)
        kept = (_KeptFeatures(capture_layers, prefill, B, input_ids.shape[1], max_new_tokens, device) if capture_layers
                else None)
        pending = input_ids[:, -1]                                              # (B,)
        active = torch.ones(B, dtype=torch.bool, device=device)
        max_remaining = max_new_tokens
        t_prev = t_start = _clock(device)

        while True:
            # 2. Draft K tokens; K never drafts past the budget (the token after the last draft comes free).
            K = max(min(policy.gamma(), policy.max_gamma, max_remaining - 1), 0)
            proposal = drafter.propose(K, draft_sampler)
            drafts = proposal.tokens.to(device)                                # (B, K') with K' <= K
            K = drafts.shape[1]
            q = None if proposal.probs is None else proposal.probs.to(device)  # (B, K, V); None = one-hot at drafts

            # 3. Verify: one target forward over [pending, d_1..d_K] scores every draft plus the bonus position.
            out_t = target.step(torch.cat([pending[:, None], drafts], dim=1), **hidden)
            logits = out_t.logits                                               # (B, K+1, V)
            p = None if sampler.greedy else sampler.probs(logits)              # (B, K+1, V) processed
            verdict = verify_greedy(drafts, logits) if sampler.greedy else verify_sampling(drafts, q, p, generator)
            n = verdict.num_accepted                                            # (B,)

            # 4. Emit accepted drafts + next token, cut at EOS and at max_new_tokens.
            offset = out.length
            count, done = _emit_counts(verdict.tokens, verdict.num_emitted, offset, max_new_tokens, eos, active)
            out.append(verdict.tokens, count)
            if kept is not None:
                kept.add(out_t, offset, count)
            going = active & ~done

            # 5. Roll back: rows that go on keep [pending, accepted drafts]; next_token becomes their pending token.
            #    Both commits' device halves now, their host halves after the round's one sync (below).
            col = torch.arange(K + 1, device=device)
            target_plan = target.commit_begin((col <= n[:, None]) & going[:, None])
            draft_plan = drafter.commit_begin(n, verdict.next_token, going,
                                              target_hidden=getattr(out_t, "hidden_states", None))
            pending = torch.where(going, verdict.next_token, pending)

            # 6. Counters from sums over active rows (ratios are taken from these sums, never averaged).
            accepted = verdict.accepted & active[:, None]                       # (B, K)
            stats["target_forwards"] += active.long()
            stats["accept_hist"].scatter_add_(0, n, active.long())
            stats["position_proposed"][:K] += active.sum()
            stats["position_accepted"][:K] += accepted.sum(0)
            stats["position_alpha"][:K] += (verdict.alpha * active[:, None]).sum(0)
            rounds.append(RoundRecord(
                gamma=K, active=active, offset=offset, draft_tokens=drafts, accepted=accepted,
                num_accepted=n * active, next_token=verdict.next_token, num_emitted=count,
                alpha=verdict.alpha * active[:, None],
                target_logits=logits if record else None,
            ))

            # The round's one host sync: loop control and both commits' crop sizes (nothing syncs per token).
            remaining = torch.where(going, max_new_tokens - out.length, 0).max()
            host = torch.cat([torch.stack([going.sum(), accepted.sum(), active.sum(), remaining]),
                              target_plan.sizes.to(device), draft_plan.sizes.to(device)]).tolist()
            n_going, n_accepted, n_active, max_remaining = host[:4]
            target.commit_end(target_plan, host[4:7])
            drafter.commit_end(draft_plan, host[7:])
            policy.update(K * n_active, n_accepted)
            active = going
            t_now = time.perf_counter()  # the .tolist() above waited for the device
            round_seconds.append(t_now - t_prev)
            t_prev = t_now
            if n_going == 0:
                break

        return Rollout(sequences=out.tokens[:, :max_new_tokens], num_new_tokens=out.length, rounds=rounds,
                       prefill_seconds=t_start - t0, round_seconds=round_seconds,
                       hidden=None if kept is None else kept.result(), **stats)
    finally:  # the call's caches go back now, for the next call to reuse (BatchKV.close)
        target.close()
        drafter.close()


@torch.no_grad()
def target_generate(
    target_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    capture_layers: list[int] | None = None,
    cache: CacheMode = CacheMode(),
    sync_every: int = 1,
) -> Rollout:
    """Target-only decoding on the same cache machinery: the denominator of every speedup. One forward per token.
    cache: growing (default) or static KV cache, compiled or not (kv.CacheMode).
    sync_every: decode steps between host syncs (whether every row has stopped). 1 times every step on its own; more
    lets the host queue steps ahead of the device (their round_seconds share the interval's time evenly), at the cost
    of up to sync_every - 1 steps decoded after the last row stopped (never emitted).

    capture_layers: HF hidden_states ids (0 = embeddings, L = after the final norm) to return in Rollout.hidden, for
    regeneration that writes EAGLE-3 training features as it decodes (data/regenerated.py): the decode computes them
    anyway, so the target runs once per training token."""
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1 (decode steps between host syncs), got {sync_every}")
    sampler = Sampler(temperature, top_p, generator)
    device = device_of(target_model)
    input_ids, attention_mask = _check_inputs(target_model, input_ids, attention_mask, max_new_tokens, device)
    B = input_ids.shape[0]
    eos = _eos(eos_token_id, device)
    out = TokenBuffer(B, max_new_tokens, device, fill=_pad_id(eos_token_id))
    stats = _counters(B, 0, device)
    round_seconds: list[float] = []
    one = torch.ones(B, dtype=torch.long, device=device)

    hidden = {"output_hidden_states": True} if capture_layers else {}
    captured: list[torch.Tensor] = []

    def keep(o) -> None:
        if capture_layers and o is not None:
            captured.append(_layers(o, capture_layers))                    # (B, C, D)

    t0 = _clock(device)
    target = cache.factory(_cache_length(input_ids, max_new_tokens, 0))(target_model)
    try:
        keep(target.prefill(input_ids[:, :-1], attention_mask[:, :-1], **hidden))
        pending = input_ids[:, -1]                                              # (B,)
        active = torch.ones(B, dtype=torch.bool, device=device)
        steps = 0
        t_prev = t_start = _clock(device)
        while True:
            o = target.step(pending[:, None], **hidden)
            keep(o)
            logits = o.logits[:, -1]                                            # (B, V)
            token, _ = sampler.draw(logits)                                     # (B,)
            count, done = _emit_counts(token[:, None], one, out.length, max_new_tokens, eos, active)
            out.append(token[:, None], count)
            # Stopped rows keep decoding garbage that is never emitted: cheaper than a per-row rollback here.
            target.commit_all()
            stats["target_forwards"] += active.long()
            stats["accept_hist"] += active.sum()
            active = active & ~done
            pending = token
            steps += 1
            if steps % sync_every and steps < max_new_tokens:  # every row stops within max_new_tokens steps
                continue
            still = steps < max_new_tokens and bool(active.any())  # the one host sync per sync_every steps
            t_now = time.perf_counter()
            since = steps - len(round_seconds)
            round_seconds += [(t_now - t_prev) / since] * since
            t_prev = t_now
            if not still:
                break

        return Rollout(sequences=out.tokens[:, :max_new_tokens], num_new_tokens=out.length, rounds=[],
                       prefill_seconds=t_start - t0, round_seconds=round_seconds,
                       hidden=torch.cat(captured, dim=1) if captured else None, **stats)
    finally:  # the call's caches go back now, for the next call to reuse (BatchKV.close)
        target.close()
