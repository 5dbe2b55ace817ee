"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023), with chains or token trees (EAGLE-2; SpecInfer), and
its target-only baseline, each giving a Rollout.

Each round: a strategy (a gamma policy, or a tree shape) says what to propose; the drafter proposes N tokens under the
pending token (the root): a chain d_1..d_K, or a tree (tree.py); the target scores [pending, nodes] in ONE forward (a
tree with tree attention, positions by depth); verification (verify.py) keeps an accepted path (a chain's: a prefix)
plus one target token (correction or bonus); both caches keep [pending, accepted path] and drop the rest.
Both models' states hold every token but the last ("pending") one, so the prefill feeds prompt[:, :-1] and every
generated token comes out of a round: target forwards = rounds, and mean_accept_len = tokens / rounds.
Batch > 1: one shared cache per model with per-row masks and positions (see kv.py); rows accept different counts,
and a row that hit EOS or max_new_tokens stops counting: its later compute is wasted, never emitted, unless
drop_finished_rows takes it out of both models' batches (then the round's records hold the rows it ran, `rows`).
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
from .kv import BatchKV, CacheMode, TokenBuffer, device_of, logits_dim, max_positions, on_rows
from .sampling import DEFAULT_DRAFT_POLICY, Sampler, check_draft_policy
from .tree import Proposal, TreeShape
from .verify import PAD, Verdict, verify


# ----------------------------------------------------------------------------------------------- strategies
class Strategy(Protocol):
    """What each round proposes: a gamma policy (chains) or a TreeShape (the same tree every round)."""

    @property
    def max_shape(self) -> TreeShape: ...  # the widest proposal: the caches' room and the counters' depth

    def next_shape(self, remaining: int) -> TreeShape: ...  # this round's, with `remaining` tokens of budget left

    def update(self, proposed: int, accepted: int) -> None: ...  # drafts proposed / accepted in the last round

    adapts: bool  # update() uses what it is given (False: the loop skips bringing those counts to the host)


class GammaPolicy(Protocol):
    max_gamma: int
    adapts: bool

    def gamma(self) -> int: ...

    def update(self, proposed: int, accepted: int) -> None: ...


class _Chains:
    """A gamma policy as a Strategy: chains of gamma() drafts, none past the budget (the token after the last draft
    comes free)."""

    @property
    def max_shape(self) -> TreeShape:
        return TreeShape.chain(self.max_gamma)

    def next_shape(self, remaining: int) -> TreeShape:
        return TreeShape.chain(max(min(self.gamma(), self.max_gamma, remaining - 1), 0))


@dataclass
class FixedGamma(_Chains):
    k: int

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"gamma must be >= 0, got {self.k}")

    @property
    def max_gamma(self) -> int:
        return self.k

    adapts = False

    def gamma(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        pass


@dataclass
class DynamicGamma(_Chains):
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
    adapts = True

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
    """One verification round = one target forward. Per-row tensors over the R rows the round ran: the call's B rows,
    or with drop_finished_rows those still generating when it began, `rows` saying which (row_ids() either way); a
    row inactive this round emits nothing. K is the proposal's depth: a chain's length, a tree's deepest node; a
    tree's counters are by depth."""

    gamma: int                   # K, the proposal's depth
    active: torch.Tensor         # (B,) bool, rows still generating when the round began
    offset: torch.Tensor         # (B,) long, tokens the row had generated before this round (index into sequences)
    draft_tokens: torch.Tensor   # (B, K) a chain's drafts; a tree's accepted path's drafts, then PAD
    accepted: torch.Tensor       # (B, K) bool, the accepted path reached depth k+1
    num_accepted: torch.Tensor   # (B,)
    next_token: torch.Tensor     # (B,) correction or bonus (meaningless where not active)
    num_emitted: torch.Tensor    # (B,) tokens appended to sequences (num_accepted + 1, cut at EOS / budget)
    alpha: torch.Tensor          # (B, K) a chain's sum_x min(p, q) per drafted position, after a rejection too; a
    #                              tree's target mass on the children of the path node at depth k; 0 if inactive
    proposal: Proposal | None = None  # the round's proposal: N nodes under the root (the pending token); q not kept
    path: torch.Tensor | None = None  # trees: (B, K+1) long node ids from the root to the last accepted node, 0-padded
    # record=True only: what an on-policy trainer builds its loss from (p after processing is
    # sampling.probs_from_logits(target_logits, temperature, top_p); q is the drafter's to recompute).
    # A chain: (B, K+1, V) raw target logits at [pending, d_1..d_K]. A tree: (B, C, V) at its contexts.
    target_logits: torch.Tensor | None = None
    # trees, record=True or score_nodes=True: (B, N) the target's probability of node i's token at its parent,
    # processed at the decoding temperature (greedy: 1.0 where it is the target's argmax there, else 0): verification
    # reaches a node with the product along its path (the cost model's tree search replays trees from it:
    # eval/tree_search.py)
    node_prob: torch.Tensor | None = None
    # trees, record=True only: the contexts the draft proposed children at, the root (0) and every node with a child,
    # in node order then padded with -1 (B, C) (on-policy training on the tree: onpolicy/positions.py)
    contexts: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # (R,) long, the call's rows these are (None: all B, in order)

    def row_ids(self) -> torch.Tensor:
        """(R,) the call's row of each of this round's rows."""
        return torch.arange(self.active.shape[0], device=self.active.device) if self.rows is None else self.rows

    def on_rows(self, x: torch.Tensor, batch: int, fill=0) -> torch.Tensor:
        """A per-row tensor of this round (R, ...) -> (batch, ...), `fill` in the rows it did not run."""
        return on_rows(x, None if self.rows is None else self.rows.to(x.device), batch, fill)


@dataclass
class Rollout:
    sequences: torch.Tensor          # (B, max_new_tokens) generated tokens; pad_token after num_new_tokens
    num_new_tokens: torch.Tensor     # (B,)
    rounds: list[RoundRecord]        # empty for target_generate
    target_forwards: torch.Tensor    # (B,) rounds (decode forwards) in which the row was active; prefill excluded
    accept_hist: torch.Tensor        # (max_gamma+1,) row-rounds by num_accepted
    position_proposed: torch.Tensor  # (max_gamma,) drafts proposed at draft position k (trees: row-rounds whose tree
    #                                  reaches depth k+1), summed over row-rounds
    position_accepted: torch.Tensor  # (max_gamma,) drafts accepted at position k (trees: accepted paths reaching k+1)
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
    room = max_new_tokens - generated                                       # (B,)
    count = torch.minimum(num_emitted, room)
    if eos is None:
        count = count * active
        return count, active & (count >= room)
    is_eos = torch.isin(tokens, eos) & (torch.arange(tokens.shape[1], device=tokens.device) < count[:, None])
    hit = is_eos.any(1)
    count = torch.where(hit, is_eos.long().argmax(1) + 1, count) * active  # keep the EOS itself
    return count, active & (hit | (count >= room))


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

    def add(self, hidden_states, offset: torch.Tensor, count: torch.Tensor, rows: torch.Tensor | None) -> None:
        """hidden_states: the verify forward's per layer (R, K+1, H) of [pending, accepted path ...] for the call's
        rows `rows` (None: all); row b keeps its first count[b] columns (the tokens at offset[b] .. offset[b]+count[b]-1
        after the prompt but its last token: pending, then the accepted drafts)."""
        feats = torch.cat([hidden_states[k] for k in self.layers], dim=-1)  # (R, K+1, D)
        if self.data is None:
            self._make(feats)
        j = torch.arange(feats.shape[1], device=feats.device)
        col = torch.where(j < count[:, None], self.start + offset[:, None] + j, self.width)  # (R, K+1)
        rows = torch.arange(feats.shape[0], device=feats.device) if rows is None else rows
        self.data[rows[:, None], col] = feats.to(self.data.dtype)

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


def _path_hidden(hidden_states, path: torch.Tensor | None):
    """The target's per-layer hidden states (B, N+1, H) of a proposal -> those of its accepted path's nodes
    (B, D+1, H); a chain's path is its prefix, so they stay as they are."""
    if hidden_states is None or path is None:
        return hidden_states
    idx = path[..., None]
    return tuple(h.gather(1, idx.expand(-1, -1, h.shape[-1])) for h in hidden_states)


def _check_strategy(shape: TreeShape, draft_policy: str) -> None:
    check_draft_policy(draft_policy)
    if not shape.is_chain and draft_policy != "greedy":
        raise ValueError(f"draft_policy={draft_policy!r} with a token tree: trees propose each node's top-k children "
                         "(draft_policy='greedy'); sampled drafts are verified along chains only")


def _count_rounds(stats: dict[str, torch.Tensor], rounds: list[RoundRecord]) -> None:
    """Add a call's rounds to the counters once it ends, from sums over active rows (ratios are taken from these sums,
    never averaged), by draft position (a tree's by depth): each run of consecutive rounds of one shape over the same
    rows (the usual call: one run, or two where the budget shortens the last round) in a few kernels."""
    i = 0
    while i < len(rounds):
        first, j = rounds[i], i + 1
        shape = (first.gamma, first.proposal.is_chain, first.proposal.tokens.shape[1])
        while (j < len(rounds) and rounds[j].rows is first.rows
               and (rounds[j].gamma, rounds[j].proposal.is_chain, rounds[j].proposal.tokens.shape[1]) == shape):
            j += 1
        run, K = rounds[i:j], first.gamma
        active = torch.stack([r.active for r in run])                       # (R, B) bool
        if first.proposal.is_chain:
            proposed = active.sum()                                         # every active row drafted K
        else:
            depth = torch.stack([r.proposal.depth.max(1).values for r in run])  # (R, B) each row's tree depth
            proposed = ((torch.arange(K, device=depth.device) < depth[..., None]) & active[..., None]).sum((0, 1))
        if first.rows is None:
            stats["target_forwards"] += active.sum(0)
        else:
            stats["target_forwards"].index_add_(0, first.rows, active.sum(0))
        stats["accept_hist"].scatter_add_(0, torch.stack([r.num_accepted for r in run]).flatten(),
                                          active.flatten().long())
        stats["position_proposed"][:K] += proposed
        stats["position_accepted"][:K] += torch.stack([r.accepted for r in run]).sum((0, 1))
        stats["position_alpha"][:K] += torch.stack([r.alpha for r in run]).sum((0, 1))
        i = j


def _record(proposal: Proposal, verdict: Verdict, logits, probs, active, offset, count, rows, *, record: bool,
            score_nodes: bool) -> RoundRecord:
    """The round's RoundRecord: logits (B, N+1, V) the verify forward's, probs their processed p (None: greedy)."""
    accepted = verdict.accepted & active[:, None]                           # (B, K)
    K = accepted.shape[1]
    drafts, node_prob, contexts, target_logits = proposal.tokens, None, None, logits if record else None
    if not proposal.is_chain:
        drafts = torch.where(accepted, verdict.tokens[:, :K], PAD)
        node_prob = proposal.node_prob(logits, probs) if record or score_nodes else None
        contexts = proposal.contexts() if record else None
        target_logits = None if contexts is None else logits.gather(
            1, contexts.clamp(min=0)[..., None].expand(-1, -1, logits.shape[-1]))          # (B, C, V)
    if proposal.probs is not None:  # a sampled chain's q (B, K, V) would stay alive with the rollout
        proposal = Proposal(proposal.tokens)
    return RoundRecord(gamma=K, active=active, offset=offset, draft_tokens=drafts, accepted=accepted,
                       num_accepted=verdict.num_accepted * active, next_token=verdict.next_token, num_emitted=count,
                       alpha=verdict.alpha * active[:, None], proposal=proposal, path=verdict.path,
                       target_logits=target_logits, node_prob=node_prob, contexts=contexts, rows=rows)


# ----------------------------------------------------------------------------------------------- decoding
@dataclass
class _Call:
    """One speculative_generate call's state between its rounds (a round = one target forward)."""

    target: BatchKV                   # the target's KV cache: every token but the pending one
    drafter: Drafter
    strategy: Strategy
    sampler: Sampler                  # processes the target's logits (greedy: verification by argmax)
    draft_sampler: Sampler            # what the drafter proposes with (Sampler.for_drafts)
    generator: torch.Generator | None
    eos: torch.Tensor | None          # (E,) ids that end a row
    max_new_tokens: int
    hidden: dict                      # the target forward's kwargs: output_hidden_states when someone reads them
    out: TokenBuffer                  # (B, max_new_tokens) the generated tokens
    stats: dict[str, torch.Tensor]    # Rollout's counters
    kept: _KeptFeatures | None        # capture_layers: Rollout.hidden
    pending: torch.Tensor             # (R,) the last token: both models hold every token before it
    active: torch.Tensor              # (R,) bool, rows still generating
    record: bool
    score_nodes: bool
    drop_finished: bool               # rows that stop leave both models' batches (where both can select rows)
    max_remaining: int                # the most tokens an active row may still generate
    t_prev: float                     # when the last round ended
    rows: torch.Tensor | None = None  # (R,) the call's rows the models hold now, in their order (None: all B)
    rounds: list[RoundRecord] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)


@torch.no_grad()
def speculative_generate(
    target_model: torch.nn.Module,
    drafter: Drafter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    strategy: int | Strategy = 4,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    record: bool = False,
    draft_policy: str = DEFAULT_DRAFT_POLICY,
    capture_layers: list[int] | None = None,
    cache: CacheMode = CacheMode(),
    score_nodes: bool = False,
    drop_finished_rows: bool = False,
) -> Rollout:
    """Generate from target_model with drafts from `drafter`; lossless: greedy output equals target-only greedy,
    sampled output is distributed as the target's (same temperature / top_p processing for both models).

    strategy: what each round proposes: an int (a fixed gamma: chains of that many drafts), a gamma policy
    (FixedGamma, DynamicGamma), or a tree.TreeShape (token trees; topk=1 is a chain).
    draft_policy (sampling.DRAFT_POLICIES, temperature > 0 only): "greedy" drafts q's argmax and verifies it as a
    one-hot proposal (the serving engines' way), "sample" draws drafts from q and verifies with q (chains only: trees
    propose each node's top-k children, deterministic given the context, and "sample" is refused for them).
    record: each RoundRecord keeps the target's raw logits (a tree's: at its contexts, with node_prob) for on-policy
    training. score_nodes: a tree's RoundRecord keeps node_prob (the cost model's tree search).
    capture_layers: HF hidden_states ids whose features of every kept token come back in Rollout.hidden (on-policy
    training of EAGLE-3 heads reads them instead of running the target again).
    cache: growing (default) or static KV caches, compiled or not (kv.CacheMode), for the target and LM drafts.
    drop_finished_rows: a row that stops leaves both models' batches after its last round, so later forwards compute
    for the rows still generating only (growing caches and drafters that can select rows; else ignored). The tokens
    are the same (up to float rounding of a smaller batch); the RoundRecords after a drop hold fewer rows (`rows`).
    Where a forward's cost grows with its rows (CPU, and large batches anywhere) this saves the stopped rows' share; a
    static or compiled cache keeps its rows, as its graphs are built for the batch."""
    strategy = FixedGamma(strategy) if isinstance(strategy, int) else strategy
    widest = strategy.max_shape
    _check_strategy(widest, draft_policy)
    sampler = Sampler(temperature, top_p, generator)
    device = device_of(target_model)
    input_ids, attention_mask = _check_inputs(target_model, input_ids, attention_mask, max_new_tokens, device)
    _check_draft_vocab(target_model, drafter)
    B = input_ids.shape[0]
    hidden = {"output_hidden_states": True} if drafter.needs_hidden_states or capture_layers else {}

    # 1. Prefill both models with the prompt but its last token, which becomes the first pending token.
    t0 = _clock(device)
    new_kv = cache.factory(_cache_length(input_ids, max_new_tokens, widest.size))
    target = new_kv(target_model)
    try:
        prefill = target.prefill(input_ids[:, :-1], attention_mask[:, :-1], **hidden)
        drafter.start(input_ids, attention_mask, target_hidden=getattr(prefill, "hidden_states", None),
                      new_kv=new_kv)
        kept = (_KeptFeatures(capture_layers, prefill, B, input_ids.shape[1], max_new_tokens, device) if capture_layers
                else None)
        call = _Call(target, drafter, strategy, sampler, sampler.for_drafts(draft_policy), generator,
                     _eos(eos_token_id, device), max_new_tokens, hidden,
                     out=TokenBuffer(B, max_new_tokens, device, fill=_pad_id(eos_token_id)),
                     stats=_counters(B, widest.max_depth, device), kept=kept, pending=input_ids[:, -1],
                     active=torch.ones(B, dtype=torch.bool, device=device), record=record, score_nodes=score_nodes,
                     drop_finished=drop_finished_rows and target.selects_rows and drafter.selects_rows,
                     max_remaining=max_new_tokens,
                     t_prev=_clock(device))
        t_start = call.t_prev
        while _round(call):  # steps 2-6, one target forward each
            pass
        _count_rounds(call.stats, call.rounds)
        return Rollout(sequences=call.out.tokens[:, :max_new_tokens], num_new_tokens=call.out.length,
                       rounds=call.rounds, prefill_seconds=t_start - t0, round_seconds=call.round_seconds,
                       hidden=None if kept is None else kept.result(), **call.stats)
    finally:  # the call's caches go back now, for the next call to reuse (BatchKV.close)
        target.close()
        drafter.close()


def _round(c: _Call) -> bool:
    """One round of speculative_generate; False once every row has stopped."""
    device = c.pending.device
    # 2. Draft N nodes under the pending token; never deeper than the budget (the next token comes free).
    proposal = c.drafter.propose(c.strategy.next_shape(c.max_remaining), c.draft_sampler).to(device)

    # 3. Verify: one target forward over [pending, node 1..N] scores every node plus the bonus position.
    out_t = c.target.step(torch.cat([c.pending[:, None], proposal.tokens], dim=1),
                          **proposal.attention(c.target.length), **c.hidden)
    logits = out_t.logits                                                   # (B, N+1, V)
    probs = None if c.sampler.greedy else c.sampler.probs(logits)          # (B, N+1, V) processed
    verdict = verify(proposal, logits, probs, c.generator)
    n = verdict.num_accepted                                                # (B,)

    # 4. Emit the accepted path + next token, cut at EOS and at max_new_tokens.
    offset = c.out.length if c.rows is None else c.out.length[c.rows]      # (R,)
    count, done = _emit_counts(verdict.tokens, verdict.num_emitted, offset, c.max_new_tokens, c.eos, c.active)
    c.out.append(verdict.tokens, count, c.rows)
    path_hidden = _path_hidden(getattr(out_t, "hidden_states", None), verdict.path)  # (R, D+1, H) per layer
    if c.kept is not None:
        c.kept.add(path_hidden, offset, count, c.rows)
    going = c.active & ~done

    # 5. Commit: rows that go on keep [pending, accepted path] (a tree's path first moves to the front of the tail);
    #    next_token becomes their pending token. Both commits' device halves now, their host halves after the
    #    round's one sync (below).
    if verdict.path is not None:
        c.target.gather_tail(verdict.path)
    keep = torch.arange(proposal.num_nodes + 1, device=device) < ((n + 1) * going)[:, None]  # (B, N+1)
    target_plan = c.target.commit_begin(keep)
    draft_plan = c.drafter.commit_begin(n, verdict.next_token, going, target_hidden=path_hidden, path=verdict.path)
    c.pending = torch.where(going, verdict.next_token, c.pending)

    # 6. The round's record (the counters sum the records once the call ends).
    rnd = _record(proposal, verdict, logits, probs, c.active, offset, count, c.rows, record=c.record,
                  score_nodes=c.score_nodes)
    c.rounds.append(rnd)

    # The round's one host sync: loop control (the most tokens a going row may still emit: 0 once none goes), both
    # commits' crop sizes, the acceptance a dynamic gamma adapts to, and (drop_finished) which rows go on; nothing
    # syncs per token.
    remaining = torch.where(going, c.max_new_tokens - c.out.length if c.rows is None else
                            c.max_new_tokens - (offset + count), 0).max()
    counts = [torch.stack([rnd.accepted.sum(), c.active.sum()])] if getattr(c.strategy, "adapts", True) else []
    host = torch.cat([remaining[None], target_plan.sizes.to(device), draft_plan.sizes.to(device), *counts]
                     + ([going.long()] if c.drop_finished else [])).tolist()
    c.max_remaining = host[0]
    end = 4 + draft_plan.sizes.numel()
    c.target.commit_end(target_plan, host[1:4])
    c.drafter.commit_end(draft_plan, host[4:end])
    if getattr(c.strategy, "adapts", True):
        n_accepted, n_active = host[end: end + 2]
        c.strategy.update(rnd.gamma * n_active, n_accepted)
        end += 2
    c.active = going
    if c.drop_finished:
        rows_going = [i for i, g in enumerate(host[end:]) if g]
        if 0 < len(rows_going) < going.shape[0]:
            _drop_finished(c, torch.tensor(rows_going, device=device))
    n_going = c.max_remaining > 0  # a going row has room for at least one more token
    t_now = time.perf_counter()  # the .tolist() above waited for the device
    c.round_seconds.append(t_now - c.t_prev)
    c.t_prev = t_now
    return n_going > 0


def _drop_finished(c: _Call, keep: torch.Tensor) -> None:
    """Only the rows `keep` (R',) of the R the models hold go on: the others leave both models' batches."""
    c.target.select_rows(keep)
    c.drafter.select_rows(keep)
    c.pending, c.active = c.pending[keep], c.active[keep]
    c.rows = keep if c.rows is None else c.rows[keep]


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
    round_seconds: list[float] = []

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
            token, _ = sampler.draw(o.logits[:, -1])                            # (B,)
            # An active row emits its token (it has room: a row stops when its budget is spent) and stops at EOS or
            # at the budget; stopped rows keep decoding garbage that is never emitted (cheaper than a rollback).
            out.append_one(token, active)
            target.commit_all()
            active = active & (out.length < max_new_tokens)
            if eos is not None:
                active = active & ~torch.isin(token, eos)
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

        # One forward per emitted token: a row's forwards are its tokens, and every one is "accepted with 0 drafts".
        stats = _counters(B, 0, device)
        stats["target_forwards"], stats["accept_hist"] = out.length.clone(), out.length.sum()[None]
        return Rollout(sequences=out.tokens[:, :max_new_tokens], num_new_tokens=out.length, rounds=[],
                       prefill_seconds=t_start - t0, round_seconds=round_seconds,
                       hidden=torch.cat(captured, dim=1) if captured else None, **stats)
    finally:  # the call's caches go back now, for the next call to reuse (BatchKV.close)
        target.close()
