"""EAGLE-3 drafting (Li et al. 2025, arXiv 2503.01840): the one-layer head reads the target's fused hidden states.

Bookkeeping, in the head's training semantics (model.py): slot t pairs the fused target feature g_t (the
target's aux hidden states at position t) with the embedding of token t+1, predicts token t+2, RoPE position t.
With context x_0 .. x_{N-1} where x_{N-1} is pending (the target has seen x_0 .. x_{N-2}), the head's cache holds
the slots 0 .. N-3 and slot N-2 (g_{N-2} with the pending x_{N-1}) is the first draft step: it predicts d_1.
Draft step j > 0 stays on slot N-2 and feeds d_j with the head's own pre-norm output as g, position N-2+j, and
attends to the cached slots plus the earlier draft steps (the TTT's step-diagonal attention).

Like LMDrafter, the not-yet-cached slots wait as a "pending block" that propose() feeds first: at start, every
prompt slot (prefill features of x_0 .. x_{T-2} with tokens x_1 .. x_{T-1}); after a round that accepted n drafts,
the n+1 slots whose features the verify forward over [pending, d_1 .. d_K] just produced: g of the old pending and
of d_1 .. d_n, paired with d_1 .. d_n and next_token. Draft-step slots are never kept (their g is the head's own
output, not the target's), so commit() crops them off and keeps the pending block's real slots: a row that kept
fewer than the widest row leaves masked holes, as in kv.BatchKV (keys carry their RoPE position, so holes are exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdistill.decoding.drafters import (DraftCommit, Drafter, Proposal, aux_hidden_states, check_confidence,
                                           unsure)
from specdistill.decoding.kv import BatchKV, CacheMode
from specdistill.decoding.sampling import Sampler
from specdistill.decoding.tree import TreeShape, grow

from .compiled import HeadSlot, compiled_head
from .model import Eagle3Head, SlotCache


class Eagle3Drafter(Drafter):
    """Proposes target ids from an Eagle3Head; q is expressed over the target vocabulary (zero outside t2d).

    The sampler's temperature / top_p act on the draft-vocabulary logits, then ids map to the target's via d2t.
    After each propose(), `logits` (B, k', Vd) holds the raw draft-vocabulary logits of every draft step.
    confidence > 0: dynamic draft length, as LMDrafter: a round stops drafting once every row's latest draft has
    probability below it (k' <= k drafts proposed; that last draft is still proposed).
    """

    needs_hidden_states = True
    grows_trees = True

    def __init__(self, head: Eagle3Head, confidence: float = 0.0):
        self.head = head
        self.slot: HeadSlot | None = None  # compiled draft steps' slot (eval.compile), held from start() to close()
        self.confidence = check_confidence(confidence)
        self.vocab_size = head.config.vocab_size  # V: proposals and q are over the target's vocabulary
        self.aux_layer_ids = list(head.config.aux_layer_ids)
        self.logits: torch.Tensor | None = None
        self._columns: dict[tuple, torch.Tensor] = {}  # (value, B, device) -> a (B, 1) bool column (_column)

    # ------------------------------------------------------------------------------------------- features
    def _features(self, target_hidden) -> torch.Tensor:
        """HF hidden_states tuple (per layer (B, C, Ht)) -> fused features g (B, C, H)."""
        fc = self.head.fc
        aux = aux_hidden_states(target_hidden, self.aux_layer_ids, "Eagle3Drafter")  # (B, C, 3Ht)
        return fc(aux.to(device=fc.weight.device, dtype=fc.weight.dtype))            # (B, C, H)

    def _set_pending(self, tokens, g, keep, last) -> None:
        self.pending_tokens = tokens  # (B, P) token x_{t+1} of each slot (target ids)
        self.pending_g = g            # (B, P, H) fused target feature g_t of each slot
        self.pending_keep = keep      # (B, P) bool: a real slot, cached at commit
        self.pending_last = last      # (B,) the slot that drafts (pairs the row's pending token); fed even if not kept

    # ------------------------------------------------------------------------------------------- protocol
    @torch.no_grad()
    def start(self, input_ids, attention_mask, target_hidden=None, new_kv=BatchKV) -> None:
        """The head keeps its own one-layer cache (a SlotCache, written in place). new_kv says the call's cache mode:
        compiled (CacheMode.compile), the head's forwards of a chain round (the pending block, padded, and the
        one-token draft steps) run as compiled graphs on a fixed cache of a slot held until close() (compiled.py)."""
        head = self.head
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device).bool()
        B, T = input_ids.shape
        c = head.config
        self.close()
        mode, columns = CacheMode.of_factory(new_kv)
        if mode.compile:
            self.compiled = compiled_head(head, mode.backend)
            columns = mode.max_length or columns or T + 256  # the target's columns of this call (or of the run)
            need = columns + columns // 4 + 128             # and room for drafted columns and holes
            self.slot = self.compiled.acquire(self, B, need)
            self.cache = self.slot.cache                                    # (bucket, nh, S, hd), B rows used
            self.first_slot = torch.zeros(B, dtype=torch.long, device=device)  # a one-token step reads its slot 0
        else:
            self.cache = SlotCache(B, c.num_attention_heads, c.head_dim, device, dtype, capacity=T + 256)
        self.mask = torch.zeros(B, 0, dtype=torch.bool, device=device)  # (B, S) real cached slots
        self.length = torch.zeros(B, dtype=torch.long, device=device)   # (B,) cached slots = next slot's position
        last = torch.full((B,), max(T - 2, 0), dtype=torch.long, device=device)
        if T == 1:  # no target features at all: one feature-less slot for the pending token (drafts are guesses)
            g = torch.zeros(B, 1, c.hidden_size, device=device, dtype=dtype)
            self._set_pending(input_ids, g, torch.zeros(B, 1, dtype=torch.bool, device=device), last)
            self.pending_is_prefix = True
            return
        # Slot c (column c of the left-padded prompt) pairs the prefill feature at c with the token at c+1; real
        # iff the token at c is (left padding). A row of one token has no slot, only its pending token.
        keep = attention_mask[:, :-1]                                       # (B, T-1)
        g = self._features(target_hidden)[:, -(T - 1):] * keep[..., None]   # (B, T-1, H) zero where not real
        self._set_pending(input_ids[:, 1:], g, keep, last)
        self.pending_is_prefix = False  # left padding: a row's real slots end the block

    def _pending_step(self, drafts: int | None = None):
        """Feed the pending block: cacheable slots, and per row the drafting slot (step 0 of the TTT unroll).
        Returns the drafting slot's logits (B, Vd), its output h (B, 1, H), its position (B,) and the usable keys
        (B, S+P) so far. Compiled (a chain of `drafts` drafts): the block runs padded to its graph's width
        (self.pending_pad slots after the P fed, never usable)."""
        tokens_p, keep = self.pending_tokens, self.pending_keep            # (B, P)
        B, P = tokens_p.shape
        rows = torch.arange(B, device=tokens_p.device)
        is_last = torch.arange(P, device=keep.device) == self.pending_last[:, None]
        positions = (self.length[:, None] + keep.long().cumsum(1) - 1).clamp(min=0)  # (B, P)
        key_mask = torch.cat([self.mask, keep | is_last], dim=1)            # (B, S+P)
        width = None if self.slot is None or drafts is None else self.compiled.pending_width(self.slot, P, drafts)
        self.pending_pad = 0 if width is None else width - P  # an eager block (the prompt's) is fed unpadded
        if width is not None:
            h, logits = self.compiled.run(self.slot, tokens_p, self.pending_g, positions, key_mask, self.pending_last,
                                          width=width)
            return logits, h, positions[rows, self.pending_last], key_mask
        out = self.head.step(tokens_p, self.pending_g, positions, self.cache, key_mask,
                             readout_slot=self.pending_last)                # logits of the drafting slot only
        h = out.hidden[rows, self.pending_last][:, None]                    # (B, 1, H)
        return out.logits[:, 0], h, positions[rows, self.pending_last], key_mask

    @torch.no_grad()
    def propose(self, shape: TreeShape, sampler: Sampler) -> Proposal:
        return self._chain(shape.size, sampler) if shape.is_chain else self._tree(shape)

    def _column(self, value: bool, B: int, device) -> torch.Tensor:
        """A (B, 1) bool column of `value`, made once per batch size (never written to)."""
        key = (value, B, torch.device(device))
        if key not in self._columns:
            self._columns[key] = torch.full((B, 1), value, dtype=torch.bool, device=device)
        return self._columns[key]

    def _chain(self, k: int, sampler: Sampler) -> Proposal:
        """k drafts: the pending block, then one TTT step per further draft."""
        head = self.head
        tokens_p = self.pending_tokens
        B = tokens_p.shape[0]
        # 1. The pending block.
        logits, h, pos, key_mask = self._pending_step(k)                    # (B, Vd), (B, 1, H), (B,), (B, S+P)
        ones, zeros = self._column(True, B, key_mask.device), self._column(False, B, key_mask.device)  # (B, 1) bool
        # 2. Draft steps: step j feeds d_j with the head's own output, position + j, same slot (TTT step j).
        tokens, probs, step_logits = [], [], []
        for j in range(k):
            step_logits.append(logits)
            draft_id, q = sampler.draw(logits)                              # (B,), (B, Vd) | None
            token = head.draft_to_target(draft_id)                          # (B,) target ids
            tokens.append(token)
            probs.append(q)
            if j == k - 1 or unsure(logits, draft_id, q, self.confidence):
                break
            if self.slot is not None:  # the first draft step writes every draft step's columns; slot 0 reads out
                seen = None if j else torch.cat([key_mask, zeros.expand(-1, self.pending_pad),
                                                 ones.expand(-1, k - 1)], dim=1)  # (B, S+W+k-1): padding unseen
                h, logits = self.compiled.run(self.slot, token[:, None], h, (pos + j + 1)[:, None], seen,
                                              self.first_slot if j == 0 else None)
            else:
                key_mask = torch.cat([key_mask, ones], dim=1)
                out = head.step(token[:, None], h, (pos + j + 1)[:, None], self.cache, key_mask)
                h, logits = out.hidden, out.logits[:, 0]
        Vd = logits.shape[-1]
        self.logits = torch.stack(step_logits, 1) if k else logits.new_zeros(B, 0, Vd)  # (B, k', Vd)
        self.tokens = torch.stack(tokens, 1) if k else tokens_p.new_zeros(B, 0)           # (B, k')
        if sampler.greedy:
            return Proposal(self.tokens, None)
        # q over the target vocabulary: draft-vocab probs scattered to their target ids, zero elsewhere.
        q_draft = torch.stack(probs, 1) if k else logits.new_zeros(B, 0, Vd).float()      # (B, k, Vd)
        kept_ids = head.draft_to_target(torch.arange(Vd, device=q_draft.device))          # (Vd,)
        q = q_draft.new_zeros(B, q_draft.shape[1], self.vocab_size)
        q[..., kept_ids] = q_draft
        return Proposal(self.tokens, q)

    @torch.no_grad()
    def commit(self, num_accepted, next_token, active, target_hidden=None, path=None) -> None:
        plan = self.commit_begin(num_accepted, next_token, active, target_hidden, path)
        self.commit_end(plan, plan.sizes.tolist())  # one host sync

    @torch.no_grad()
    def commit_begin(self, num_accepted, next_token, active, target_hidden=None, path=None) -> DraftCommit:
        """The crop widths as a device tensor (sizes: last kept pending column, widest row, new pending width).
        A tree's accepted path becomes the drafts: no draft-step slot is kept either way."""
        if path is not None:
            self.tokens = F.pad(self.tree.tokens, (1, 0)).gather(1, path.to(self.tree.tokens.device))[:, 1:]  # (B, D)
        device = self.length.device
        n, next_token, active = num_accepted.to(device), next_token.to(device), active.to(device)
        keep = self.pending_keep & active[:, None]                          # (B, P)
        P = keep.shape[1]
        count = keep.sum(1)                                                 # (B,)
        if self.pending_is_prefix:  # a row's real slots lead the block: the last kept column is the longest row's
            last = count.max()
        else:                       # the prompt's block, left-padded
            kept_cols = torch.where(keep.any(0), torch.arange(P, device=device) + 1, 0)
            last = kept_cols.max() if P else kept_cols.new_zeros(())
        widest = (self.length + count).max()                                # length: each row's real cached slots
        width = ((n + 1) * active).max()                                    # the new pending block's width
        sizes = torch.stack([last, widest, width])                          # (3,)
        return DraftCommit(sizes, (n, next_token, active, keep, count, target_hidden))

    @torch.no_grad()
    def commit_end(self, plan: DraftCommit, sizes: list[int]) -> None:
        n, next_token, active, keep, count, target_hidden = plan.state
        last, widest, width = sizes
        device = self.length.device
        S0 = self.mask.shape[1]
        # 1. Cache: keep the pending block's real slots of rows that go on; crop the rest of the block and every
        #    draft-step slot.
        fed = self.cache.length - S0
        self.cache.crop(S0 + last)
        self.mask = torch.cat([self.mask, keep[:, :last]], dim=1)
        self.length = self.length + count
        S = self.mask.shape[1]
        room = 2 * fed + 64  # a fixed cache: twice the columns this round fed (a pending block, drafts or a tree)
        if S - widest > max(32, S // 4) or (self.cache.fixed and S + room > self.cache.capacity):
            self._compact(widest)
        # 2. New pending block: the verify forward's features for [pending, d_1 .. d_n] (positions length ..
        #    length + n) paired with [d_1 .. d_n, next_token]. Stopped rows get one slot that is fed, never kept.
        width = max(width, 1)
        g = self._features(target_hidden)[:, :width]                        # (B, width, H)
        emitted = torch.cat([self.tokens, next_token[:, None]], dim=1)     # (B, k+1)
        emitted = emitted.scatter(1, n[:, None], next_token[:, None])[:, :width]
        col = torch.arange(width, device=device)
        new_keep = (col <= n[:, None]) & active[:, None]                    # (B, width)
        self._set_pending(emitted, g * new_keep[..., None], new_keep, torch.where(active, n, 0))
        self.pending_is_prefix = True

    def close(self) -> None:
        if self.slot is not None:
            self.compiled.release(self.slot)
            self.slot = None

    @property
    def selects_rows(self) -> bool:
        return self.slot is None  # compiled draft steps keep their bucket's rows

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.length.device)
        self.cache.select_rows(rows)
        self.mask, self.length = self.mask[rows], self.length[rows]
        self._set_pending(self.pending_tokens[rows], self.pending_g[rows], self.pending_keep[rows],
                          self.pending_last[rows])

    # ------------------------------------------------------------------------------------------- token trees
    def _tree(self, shape: TreeShape) -> Proposal:
        """EAGLE-2 expansion (tree.grow) with the head: a depth-d node is fed as TTT step d, its parent's output as g
        at position (drafting slot's) + d, attending to the usable cache, its ancestors and itself (query_mask)."""
        logits, h, pos, key_mask = self._pending_step()
        outputs = [h]                                                       # per fed depth: (B, k, H)

        def feed(tokens, visible, d, parent):
            B, k = tokens.shape
            g = outputs[-1].gather(1, parent[..., None].expand(-1, -1, h.shape[-1]))      # (B, k, H)
            allow = torch.cat([key_mask[:, None, :].expand(-1, k, -1), visible], dim=2)   # (B, k, S+P+F)
            out = self.head.step(tokens, g, (pos + d)[:, None].expand(-1, k), self.cache, query_mask=allow)
            outputs.append(out.hidden)
            return out.logits                                               # (B, k, Vd)

        self.tree = grow(shape, logits, feed, to_target=self.head.draft_to_target)
        return self.tree

    def _compact(self, widest: int) -> None:
        """Right-align every row's real cached slots (order kept) and drop the columns that are holes in all rows."""
        S = self.mask.shape[1]
        order = torch.sort(self.mask.int(), dim=1, stable=True).indices[:, S - widest:]  # (B, widest)
        self.cache.select(order)                                            # (B, nh, widest, hd)
        self.mask = self.mask.gather(1, order)
