"""Drafters propose tokens for the target to verify: a standalone LM with its own KV cache, or prompt lookup (n-grams).

The protocol, per generation: start(prompt) once, then each round propose(shape) -> Proposal (a chain of up to k
drafts, or a token tree: tree.TreeShape) and commit(verdict info), and close() when the call ends (a drafter on a
compiled cache hands its slot back for the next call to reuse).
A decoding loop that brings its own values to the host once per round commits in two halves: commit_begin() (device
work, its host-needed sizes as a tensor), then commit_end() with those sizes, synced together with the loop's own.
Like the target, a drafter holds every token but the last ("pending") one in its state: propose() feeds the
pending token(s) and drafts; commit() keeps the accepted drafts (a tree's: its accepted path) and makes next_token the
new pending token.
Rows whose `active` flag is False have stopped: they keep nothing and their proposals are ignored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .kv import BatchKV, CacheMode, TokenBuffer, device_of, logits_dim, max_positions
from .sampling import Sampler
from .tree import Proposal, TreeShape, grow


def check_confidence(confidence: float) -> float:
    if not 0.0 <= confidence < 1.0:
        raise ValueError(f"draft confidence threshold must be in [0, 1), got {confidence}")
    return confidence


def aux_hidden_states(target_hidden, aux_layer_ids: list[int], drafter: str) -> torch.Tensor:
    """The target layers a feature-reading drafter reads, concatenated: HF hidden_states tuple (per layer (B, C, Ht))
    -> (B, C, K*Ht) for K = len(aux_layer_ids). `drafter` names it in the errors (no hidden states: it was not run
    through speculative_generate; too few: it was built for another target)."""
    if target_hidden is None:
        raise ValueError(f"{drafter} needs the target's hidden states: run it through speculative_generate (which "
                         "passes output_hidden_states=True to the target for drafters that need them)")
    if max(aux_layer_ids) >= len(target_hidden):
        raise ValueError(f"{drafter} reads hidden_states {list(aux_layer_ids)} (its aux_layer_ids) but the target "
                         f"returned {len(target_hidden)}: the draft was built for another target")
    return torch.cat([target_hidden[k] for k in aux_layer_ids], dim=-1)


def unsure(logits: torch.Tensor, token: torch.Tensor, q: torch.Tensor | None, confidence: float) -> bool:
    """Dynamic draft length: True when every row's latest draft has probability < confidence, so the round stops
    drafting (that draft is still proposed). logits (B, V), token (B,) ids into V, q (B, V) the sampler's processed
    probs (None when greedy: softmax of logits). confidence 0 never stops. One host sync per draft step."""
    if confidence <= 0:
        return False
    probs = q if q is not None else logits.float().softmax(-1)
    return bool((probs.gather(1, token[:, None]) < confidence).all())


@dataclass
class DraftCommit:
    """Drafter.commit_begin()'s result: the sizes commit_end() needs on the host, and what it applies them to."""

    sizes: torch.Tensor  # (n,) long on the device (n may be 0)
    state: Any = None    # the drafter's own: whatever commit_end() needs besides the sizes
    whole: tuple | None = None  # commit()'s arguments, when the whole commit runs in commit_end()


class Drafter(ABC):
    vocab_size: int | None = None     # size of q's vocab; None: proposes token ids from the context, any vocab
    needs_hidden_states: bool = False  # EAGLE-style heads: the loop passes the target's hidden states to start/commit
    grows_trees: bool = False          # propose() grows token trees (topk > 1) from the draft's scores of alternatives
    max_tree_depth: int | None = None  # the deepest token tree propose() grows (None: any; a block drafter: B-1)

    @abstractmethod
    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, target_hidden=None,
              new_kv: Callable[[torch.nn.Module], BatchKV] = BatchKV) -> None:
        """Left-padded prompt (B, T). target_hidden: the target's per-layer hidden states for input_ids[:, :-1].
        new_kv(model) -> BatchKV: the KV caches of this call (kv.CacheMode.factory: static and compiled, or growing),
        for drafters that run a causal LM on BatchKV; others ignore it."""

    @abstractmethod
    def propose(self, shape: TreeShape, sampler: Sampler) -> Proposal:
        """A chain (shape.is_chain): up to shape.size drafts per row, sampled from q at temperature > 0, argmax at
        temperature 0; a drafter may return fewer columns (n-gram lookup with no match anywhere returns 0), the round
        verifies what it got. A tree (grows_trees drafters only): decoding/tree.py's expansion under each row's
        pending token from the draft's scores, top-k children deterministic given the context (verified one-hot)."""

    @abstractmethod
    def commit(self, num_accepted: torch.Tensor, next_token: torch.Tensor, active: torch.Tensor,
               target_hidden=None, path: torch.Tensor | None = None) -> None:
        """Row b accepted its first num_accepted[b] drafts, then next_token[b] (B,). active (B,) bool: rows going on.
        path: after a tree, the accepted nodes are path[b, 1 : num_accepted[b] + 1] (path (B, D+1) node ids from the
        root); None after a chain.

        target_hidden: the target's per-layer hidden states (B, n+1, H) of [pending, accepted drafts ...] from the
        verification forward (a chain's: all k+1 columns; a tree's: its path's), only when needs_hidden_states; row b
        keeps the first 1 + num_accepted[b].
        """

    def commit_begin(self, num_accepted: torch.Tensor, next_token: torch.Tensor, active: torch.Tensor,
                     target_hidden=None, path: torch.Tensor | None = None) -> DraftCommit:
        """commit()'s device half: nothing brought to the host. This default defers the whole commit to
        commit_end() (drafters whose commit needs no host value, or syncs on its own)."""
        return DraftCommit(num_accepted.new_zeros(0), whole=(num_accepted, next_token, active, target_hidden, path))

    def commit_end(self, plan: DraftCommit, sizes: list[int]) -> None:
        """commit()'s host half: sizes are plan.sizes on the host."""
        self.commit(*plan.whole)

    def close(self) -> None:
        """The decoding call ended: free what the call held for the next one (a compiled cache's slot)."""
        return None

    @property
    def selects_rows(self) -> bool:
        """select_rows() is possible now (after start())."""
        return False

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the rows `rows` (R,) long, in that order, after a commit: the decoding loop drops rows that stopped,
        so no later round drafts for them. Only where selects_rows."""
        raise NotImplementedError(f"{type(self).__name__} keeps every row of its batch")

    def chain_only(self, shape: TreeShape) -> int:
        """The chain length a chain-only drafter drafts for `shape`; a token tree is refused."""
        if not shape.is_chain:
            raise ValueError(f"{type(self).__name__} proposes one token per position: token trees need a drafter "
                             "that scores alternatives (an LM draft, an EAGLE-3 head or a DFlash drafter)")
        return shape.size

    def prepare(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Work a drafter needs before these prompts (B, T) are decoded, done outside the timed decoding: the
        evaluator calls it for every batch it builds. Most drafters need none; the oracle decodes the target here."""
        return None


class LMDrafter(Drafter):
    """Any HF causal LM sharing the target's vocabulary, drafting autoregressively from its own KV cache.

    Positions past the draft's max_position_embeddings are clamped: poor drafts there, output still lossless.
    confidence > 0: stop drafting early once every row's latest draft has probability below it (that draft is still
    proposed), as HF assisted generation's assistant_confidence_threshold: a weak draft stops wasting verify width.
    """

    grows_trees = True

    def __init__(self, model: torch.nn.Module, confidence: float = 0.0):
        self.model = model
        self.vocab_size = logits_dim(model)
        self.confidence = check_confidence(confidence)

    def start(self, input_ids, attention_mask, target_hidden=None, new_kv=BatchKV) -> None:
        limit = max_positions(self.model)
        longest = int(attention_mask.sum(1).max())
        if limit is not None and longest > limit:
            raise ValueError(f"prompt of {longest} tokens exceeds the draft's max_position_embeddings={limit}: "
                             "shorten the prompt or use a draft with a longer context")
        device = device_of(self.model)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        self.kv = new_kv(self.model)
        self.kv.prefill(input_ids[:, :-1], attention_mask[:, :-1])
        self.pending = input_ids[:, -1:]                                     # (B, P) right-padded, P in {1, 2}
        self.pending_valid = torch.ones_like(self.pending, dtype=torch.bool)  # (B, P)

    @torch.no_grad()
    def propose(self, shape: TreeShape, sampler: Sampler) -> Proposal:
        return self._chain(shape.size, sampler) if shape.is_chain else self._tree(shape)

    def _chain(self, k: int, sampler: Sampler) -> Proposal:
        """k drafts, one draft step each, from the draft's own cache."""
        B, P = self.pending.shape
        rows = torch.arange(B, device=self.pending.device)
        self.kv.reserve(P + max(k - 1, 0))  # the round's steps: pending, then every draft but the last
        logits = self.kv.step(self.pending, self.pending_valid).logits       # (B, P, V)
        logits = logits[rows, self.pending_valid.sum(1) - 1]                 # (B, V) at each row's last real slot
        tokens, probs = [], []
        for i in range(k):
            token, q = sampler.draw(logits)                                  # (B,), (B, V) | None
            tokens.append(token)
            probs.append(q)
            if i == k - 1 or unsure(logits, token, q, self.confidence):
                break
            logits = self.kv.step(token[:, None]).logits[:, -1]             # (B, V)
        self.tokens = torch.stack(tokens, 1) if k else self.pending.new_zeros(B, 0)  # (B, k') with k' <= k
        if sampler.greedy:
            return Proposal(self.tokens, None)
        q = torch.stack(probs, 1) if k else logits.new_zeros(B, 0, logits.shape[-1]).float()  # (B, k, V)
        return Proposal(self.tokens, q)

    @torch.no_grad()
    def commit(self, num_accepted, next_token, active, target_hidden=None, path=None) -> None:
        if path is not None:
            self._commit_path(path, num_accepted, next_token, active)
            return
        plan = self.commit_begin(num_accepted, next_token, active, target_hidden)
        self.commit_end(plan, plan.sizes.tolist())  # one host sync

    @torch.no_grad()
    def commit_begin(self, num_accepted, next_token, active, target_hidden=None, path=None) -> DraftCommit:
        if path is not None:  # a tree's commit gathers its path's columns and syncs on its own
            return super().commit_begin(num_accepted, next_token, active, target_hidden, path)
        device = self.pending.device
        n, next_token, active = num_accepted.to(device), next_token.to(device), active.to(device)
        B, k = self.tokens.shape
        # The cache tail holds [pending slots, d_1 .. d_{k-1}]; d_k was drafted but never fed.
        fed = torch.arange(max(k - 1, 0), device=device)
        keep = torch.cat([self.pending_valid, fed < n[:, None]], dim=1) & active[:, None]
        kv_plan = self.kv.commit_begin(keep)
        # New pending: next_token, preceded by d_k where all k drafts were accepted. Stopped rows re-feed any
        # real token (its output is ignored and commit keeps nothing for them).
        full = (n == k) & (k > 0) & active                                   # (B,)
        unfed = self.tokens[:, -1] if k else next_token
        return DraftCommit(torch.cat([kv_plan.sizes, full.any().long()[None]]),  # (4,)
                           (kv_plan, unfed, full, next_token, active))

    @torch.no_grad()
    def commit_end(self, plan: DraftCommit, sizes: list[int]) -> None:
        if plan.whole is not None:
            super().commit_end(plan, sizes)
            return
        kv_plan, unfed, full, next_token, active = plan.state
        self.kv.commit_end(kv_plan, sizes[:3])
        self._pend(unfed, full, next_token, active, any_full=bool(sizes[3]))

    def close(self) -> None:
        if getattr(self, "kv", None) is not None:
            self.kv.close()

    @property
    def selects_rows(self) -> bool:
        return self.kv.selects_rows

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)
        self.pending, self.pending_valid = self.pending[rows], self.pending_valid[rows]

    def _pend(self, unfed: torch.Tensor, full: torch.Tensor, next_token: torch.Tensor, active: torch.Tensor,
              any_full: bool | None = None) -> None:
        """New pending tokens: next_token, preceded by unfed (B,) where `full` (an accepted draft the cache never
        saw). any_full: full.any() when the caller has it on the host already."""
        first = torch.where(full, unfed, torch.where(active, next_token, self.pending[:, 0]))
        second = torch.where(full, next_token, 0)
        self.pending = torch.stack([first, second], 1)                       # (B, 2)
        self.pending_valid = torch.stack([torch.ones_like(full), full], 1)
        if not (bool(full.any()) if any_full is None else any_full):
            self.pending, self.pending_valid = self.pending[:, :1], self.pending_valid[:, :1]

    # ------------------------------------------------------------------------------------------- token trees
    def _tree(self, shape: TreeShape) -> Proposal:
        """EAGLE-2 expansion (tree.grow) on the draft's cache: the pending block, then each depth's beams with tree
        attention at position (pending's) + depth. The cache tail holds [pending slots, fed beams in feeding order]."""
        B, P = self.pending.shape
        rows = torch.arange(B, device=self.pending.device)
        self.kv.reserve(P + (shape.depth - 1) * shape.topk)                 # the pending block, then the beams
        logits = self.kv.step(self.pending, self.pending_valid).logits       # (B, P, V)
        root = logits[rows, self.pending_valid.sum(1) - 1]                   # (B, V) after each row's pending token
        depth1 = self.kv.length                                              # (B,) position of the root's children
        pending_seen = torch.ones(B, shape.topk, P, dtype=torch.bool, device=root.device)  # padding masks itself

        def feed(tokens, visible, d, parent):
            positions = (depth1 + d - 1)[:, None].expand_as(tokens)
            return self.kv.step(tokens, positions=positions,
                                tail_visible=torch.cat([pending_seen, visible], dim=2)).logits  # (B, k, V)

        self.tree = grow(shape, root, feed)
        return self.tree

    def _commit_path(self, path, num_accepted, next_token, active) -> None:
        device = self.pending.device
        path, n = path.to(device), num_accepted.to(device)
        next_token, active = next_token.to(device), active.to(device)
        B, P = self.pending.shape
        D = path.shape[1] - 1
        # Tail columns to keep: the real pending slots, then the path's fed nodes (depth 1 .. n-1 always were fed,
        # having children; the node at depth n was if it was a beam).
        fed = torch.nn.functional.pad(self.tree.fed, (1, 0), value=-1).gather(1, path[:, 1:])  # (B, D)
        fed = torch.where(torch.arange(D, device=device) < n[:, None], fed, -1)
        m = (fed >= 0).sum(1)                                                # (B,) fed path nodes, a prefix
        pv = self.pending_valid.sum(1)                                       # (B,)
        i = torch.arange(P + D, device=device)
        from_path = P + fed.gather(1, (i - pv[:, None]).clamp(0, D - 1)).clamp(min=0)
        columns = torch.where(i < pv[:, None], i, from_path)                 # (B, P+D)
        self.kv.commit_path(columns, (pv + m) * active)
        last = torch.nn.functional.pad(self.tree.tokens, (1, 0)).gather(1, path.gather(1, n[:, None]))[:, 0]
        self._pend(last, (n > m) & active, next_token, active)


class NGramDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023): propose what followed the most recent earlier occurrence of the
    context's last n tokens, trying n = max_ngram down to min_ngram. Training-free; q is one-hot.

    A continuation that runs into the end of the context repeats with the match's period (what the match predicts);
    in a batch, a row with no match proposes its last token again (it is verified and rejected: lossless). When no
    row has a match the proposal is 0 wide, so the round is a plain 1-token target step instead of a (k+1)-token
    verification of filler -- as HF's prompt lookup does; on CPU a 5-token verify costs ~2 one-token steps.
    """

    selects_rows = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, input_ids, attention_mask, target_hidden=None, new_kv=BatchKV) -> None:
        self.context = TokenBuffer.from_prompt(input_ids, attention_mask)

    @torch.no_grad()
    def propose(self, shape: TreeShape, sampler: Sampler) -> Proposal:
        k = self.chain_only(shape)
        ctx, length = self.context.tokens, self.context.length              # (B, S), (B,)
        B, S = ctx.shape
        device = ctx.device
        j = torch.arange(k, device=device)
        tokens = ctx.gather(1, (length - 1)[:, None]).expand(B, k).clone()  # (B, k) fallback: the last token
        found = torch.zeros(B, dtype=torch.bool, device=device)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if S <= n:
                continue
            suffix = ctx.gather(1, (length[:, None] - n + torch.arange(n, device=device)).clamp(min=0))  # (B, n)
            starts = torch.arange(S - n + 1, device=device)
            hit = (ctx.unfold(1, n, 1) == suffix[:, None, :]).all(-1)       # (B, S-n+1)
            hit &= (starts + n < length[:, None]) & (length[:, None] > n)   # an earlier occurrence with a follower
            best = torch.where(hit, starts, -1).max(1).values               # (B,) most recent occurrence
            use = (best >= 0) & ~found
            period = (length - best - n).clamp(min=1)                       # (B,)
            cont = ctx.gather(1, (best.clamp(min=0)[:, None] + n + j % period[:, None]).clamp(max=S - 1))
            tokens = torch.where(use[:, None], cont, tokens)
            found |= use
        if not bool(found.any()):  # one host sync per round; the n-gram search is host-cheap anyway
            tokens = tokens[:, :0]
        self.tokens = tokens
        return Proposal(tokens, None)

    def commit(self, num_accepted, next_token, active, target_hidden=None, path=None) -> None:
        emitted = torch.cat([self.tokens, next_token[:, None]], dim=1)      # (B, k+1)
        emitted.scatter_(1, num_accepted[:, None], next_token[:, None])     # accepted drafts, then next_token
        self.context.append(emitted, (num_accepted + 1) * active)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.context = self.context.select_rows(rows)


class OracleDrafter(Drafter):
    """Replays the target's own greedy continuation: at temperature 0 every draft is accepted, so tau = gamma + 1
    (but where a row ends at EOS or the budget) and drafting costs nothing. Speculative decoding with it measures the
    decoder's own overhead: its speedup over target-only decoding is at most (gamma + 1) / v(gamma + 1), v(k) being a
    k-token verify forward's time over a 1-token forward's.

    prepare(input_ids, attention_mask) decodes the continuation first, by target-only greedy decoding (target_generate)
    of max_new_tokens tokens per row, EOS ignored (a continuation past EOS is never reached); start() refuses a batch
    it did not prepare, so the continuation's cost never lands in a timed call. Each round proposes the next k tokens
    of the continuation at the row's offset (tokens it generated so far). Chains only: a replay has no alternatives to
    grow token trees from. A float near-tie that the (k+1)-token verify forward breaks otherwise than the 1-token
    forwards did ends a row's agreement with the replay: still lossless, a lower tau.
    """

    selects_rows = True

    def __init__(self, target_model: torch.nn.Module, max_new_tokens: int, cache: CacheMode = CacheMode()):
        if max_new_tokens < 1:
            raise ValueError(f"the oracle replays max_new_tokens >= 1 tokens per prompt, got {max_new_tokens}")
        self.target_model, self.max_new_tokens, self.cache = target_model, max_new_tokens, cache
        self.vocab_size = logits_dim(target_model)
        self._continuations: dict[tuple, torch.Tensor] = {}  # prompt batch -> (B, max_new_tokens) greedy tokens

    @staticmethod
    def _key(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
        """A left-padded batch's identity: its real tokens and mask, whatever the padding id, dtype or device."""
        mask = attention_mask.long().cpu()
        return tuple(input_ids.shape), (input_ids.long().cpu() * mask).numpy().tobytes(), mask.numpy().tobytes()

    @torch.no_grad()
    def prepare(self, input_ids, attention_mask) -> None:
        key = self._key(input_ids, attention_mask)
        if key in self._continuations:
            return
        from .generate import target_generate  # generate.py imports this module to run drafters

        rollout = target_generate(self.target_model, input_ids, attention_mask, max_new_tokens=self.max_new_tokens,
                                  cache=self.cache)
        self._continuations[key] = rollout.sequences                        # (B, max_new_tokens)

    def start(self, input_ids, attention_mask, target_hidden=None, new_kv=BatchKV) -> None:
        key = self._key(input_ids, attention_mask)
        if key not in self._continuations:
            raise ValueError("OracleDrafter.start: this prompt batch was not prepared; call oracle.prepare(input_ids, "
                             "attention_mask) on the same batch before decoding it (the evaluator does so for every "
                             "batch it builds)")
        self.continuation = self._continuations[key].to(input_ids.device)  # (B, N)
        self.offset = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)  # (B,)

    def propose(self, shape: TreeShape, sampler: Sampler) -> Proposal:
        k = self.chain_only(shape)
        N = self.continuation.shape[1]
        at = self.offset[:, None] + torch.arange(k, device=self.offset.device)  # (B, k) positions in the replay
        # Past the replay's end (a budget beyond the prepared one) its last token repeats; verification stays lossless.
        return Proposal(self.continuation.gather(1, at.clamp(max=N - 1)), None)

    def commit(self, num_accepted, next_token, active, target_hidden=None, path=None) -> None:
        device = self.offset.device
        self.offset = self.offset + (num_accepted.to(device) + 1) * active.to(device)  # accepted drafts + next_token

    def select_rows(self, rows: torch.Tensor) -> None:
        self.continuation, self.offset = self.continuation[rows], self.offset[rows]

