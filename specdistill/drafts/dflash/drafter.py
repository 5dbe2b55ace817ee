"""DFlash drafting in the shared decoding core (decoding/drafters.py's protocol): ONE draft forward per round proposes
the block's B-1 tokens.

Bookkeeping: with context x_0 .. x_{N-1} where x_{N-1} is pending (the target has run on x_0 .. x_{N-2}), the draft's
cache holds every layer's injected keys/values of the target features of x_0 .. x_{N-2} (model.py: ContextKV) and
the block is [x_{N-1}, MASK x (B-1)] at positions N-1 .. N+B-2; block position k proposes x_{N-1+k}. Its logits at k
depend on the context and the anchor only, never on the drafts before k, so a draft sampled from them is a valid
speculative proposal: verification stays lossless with q_k = the block's processed probs at position k.

After a round that accepted n drafts, the verify forward over [pending, d_1 .. d_K] gives the target features of the
old pending token and d_1 .. d_n: only those n+1 rows join the cache (the rejected drafts' never do: the cache is
cropped to what verification kept), and next_token becomes the new anchor. With a sliding window W the cache keeps
only each row's last W slots. Rows that stopped keep nothing. Holes (rows that kept fewer than the widest row) stay
as masked slots until they are a quarter of the cache, then every row is right-aligned.

Token trees come from the same one forward: block position d's top-k tokens are the children of every node at depth
d (its logits do not depend on the node they extend), and decoding/tree.grow keeps the best paths by the product of
the positions' probabilities. Verification treats them as one-hot proposals like every tree (lossless at every
temperature); the accepted path's features join the cache as a chain's accepted drafts do.
"""
from __future__ import annotations

import torch

from specdistill.decoding.drafters import Drafter, Proposal, aux_hidden_states, check_confidence, unsure
from specdistill.decoding.sampling import Sampler
from specdistill.decoding.tree import TreeShape, grow

from .model import ContextKV, DFlashDraft


class DFlashDrafter(Drafter):
    """Proposes up to B-1 target ids per round from a DFlashDraft; q is over the target vocabulary (zero outside a
    reduced draft vocabulary, whose draft ids map to target ids through d2t). After each propose(), `logits`
    (B, k', Vd) holds the block's raw logits at the proposed positions. confidence > 0: the proposal stops after the
    first position where every row's draft has probability below it (dynamic draft length; still one forward)."""

    needs_hidden_states = True
    grows_trees = True
    selects_rows = True

    def __init__(self, model: DFlashDraft, confidence: float = 0.0):
        self.model = model
        self.confidence = check_confidence(confidence)
        self.vocab_size = model.config.vocab_size
        self.aux_layer_ids = model.config.aux_layer_ids
        self.logits: torch.Tensor | None = None
        self.cache: ContextKV | None = None

    # ------------------------------------------------------------------------------------------- features
    def _features(self, target_hidden) -> torch.Tensor:
        """HF hidden_states tuple (per layer (B, C, Ht)) -> (B, C, K*Ht), the layers the draft reads."""
        return aux_hidden_states(target_hidden, self.aux_layer_ids, "DFlashDrafter")

    def _append(self, features: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> None:
        """Add C context slots per row: features (B, C, K*Ht) at positions (B, C); keep (B, C) bool marks real ones."""
        new = self.model.context(features, positions, keep)
        c = self.cache
        self.cache = ContextKV([torch.cat([a, b], 2) for a, b in zip(c.keys, new.keys)],
                               [torch.cat([a, b], 2) for a, b in zip(c.values, new.values)],
                               torch.cat([c.positions, positions], 1), torch.cat([c.valid, keep], 1))

    def _crop(self) -> None:
        """Drop slots outside the window, then right-align the rows once holes are a quarter of the cache."""
        c, W = self.cache, self.model.config.sliding_window
        if W is not None:
            c.valid = c.valid & (c.positions >= (self.anchor_pos - W)[:, None])
        S = c.valid.shape[1]
        widest = int(c.valid.sum(1).max()) if S else 0
        if S - widest <= max(32, S // 4):
            return
        order = torch.sort(c.valid.int(), dim=1, stable=True).indices[:, S - widest:]  # (B, widest) real slots last
        idx = order[:, None, :, None].expand(-1, c.keys[0].shape[1], -1, c.keys[0].shape[-1])
        self.cache = ContextKV([k.gather(2, idx) for k in c.keys], [v.gather(2, idx) for v in c.values],
                               c.positions.gather(1, order), c.valid.gather(1, order))

    # ------------------------------------------------------------------------------------------- protocol
    @torch.no_grad()
    def start(self, input_ids, attention_mask, target_hidden=None, new_kv=None) -> None:
        """new_kv is not used: the draft keeps its own per-layer context cache (it never runs an HF model)."""
        m = self.model
        device, dtype = m.fc.weight.device, m.fc.weight.dtype
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device).bool()
        B, T = input_ids.shape
        c = m.config
        empty = torch.zeros(B, c.num_key_value_heads, 0, c.head_dim, device=device, dtype=dtype)
        self.cache = ContextKV([empty] * c.num_hidden_layers, [empty] * c.num_hidden_layers,
                               torch.zeros(B, 0, dtype=torch.long, device=device),
                               torch.zeros(B, 0, dtype=torch.bool, device=device))
        self.anchor = input_ids[:, -1]                                        # (B,) the pending token
        self.anchor_pos = attention_mask.sum(1) - 1                           # (B,) its position
        if T > 1:  # the prompt but its last token: its features are the context (left padding masked)
            keep = attention_mask[:, :-1]                                     # (B, T-1)
            positions = (keep.long().cumsum(1) - 1).clamp(min=0)
            feats = self._features(target_hidden)[:, -(T - 1):].to(device)
            self._append(feats, positions, keep)
            self._crop()

    @torch.no_grad()
    def propose(self, shape: TreeShape, sampler: Sampler) -> Proposal:
        return self._chain(shape.size, sampler) if shape.is_chain else self._tree(shape)

    def _chain(self, k: int, sampler: Sampler) -> Proposal:
        """Up to k drafts from the block's positions 1 .. k, one forward."""
        B = self.anchor.shape[0]
        k = min(k, self.model.block_size - 1)
        hidden = self.model.blocks(self.cache, self.anchor[:, None], self.anchor_pos[:, None])  # (B, 1, Bs, H)
        logits = self.model.logits(hidden[:, 0, 1: 1 + k])                   # (B, k, V): block positions 1 .. k
        tokens, probs = [], []
        for i in range(k):
            draft_id, q = sampler.draw(logits[:, i])                         # (B,), (B, Vd) | None
            tokens.append(self.model.draft_to_target(draft_id))              # target ids
            probs.append(q)
            if unsure(logits[:, i], draft_id, q, self.confidence):
                break
        kept = len(tokens)
        self.logits = logits[:, :kept]
        self.tokens = torch.stack(tokens, 1) if kept else self.anchor.new_zeros(B, 0)  # (B, k')
        if sampler.greedy:
            return Proposal(self.tokens, None)
        # q over the target vocabulary: the draft vocabulary's probs at their target ids, zero elsewhere
        q_draft = torch.stack(probs, 1) if kept else logits.new_zeros(B, 0, logits.shape[-1]).float()  # (B, k', Vd)
        if q_draft.shape[-1] == self.vocab_size:
            return Proposal(self.tokens, q_draft)
        q = q_draft.new_zeros(B, kept, self.vocab_size)
        q[..., self.model.t2d] = q_draft                                      # t2d's True ids ascend with draft ids
        return Proposal(self.tokens, q)

    @torch.no_grad()
    def commit(self, num_accepted, next_token, active, target_hidden=None, path=None) -> None:
        """A tree's target_hidden holds the features of [root, path nodes]: the accepted ones join the cache as a
        chain's, so the path itself is not needed."""
        device = self.anchor.device
        n, next_token, active = num_accepted.to(device), next_token.to(device), active.to(device)
        # The verify forward's features of [pending, d_1 .. d_n] join the context at the anchor's positions onward.
        width = int(torch.where(active, n + 1, 0).max())
        if width:
            col = torch.arange(width, device=device)
            keep = (col <= n[:, None]) & active[:, None]                     # (B, width)
            feats = self._features(target_hidden)[:, :width].to(device)
            self._append(feats, self.anchor_pos[:, None] + col, keep)
        self.anchor = torch.where(active, next_token, self.anchor)
        self.anchor_pos = torch.where(active, self.anchor_pos + n + 1, self.anchor_pos)
        self._crop()

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.anchor.device)
        self.cache = self.cache.rows(rows)
        self.anchor, self.anchor_pos = self.anchor[rows], self.anchor_pos[rows]

    # ------------------------------------------------------------------------------------------- token trees
    @property
    def max_tree_depth(self) -> int:
        return self.model.block_size - 1

    def _tree(self, shape: TreeShape) -> Proposal:
        """One block forward; block position d's logits score the children of every depth-d node (module docstring)."""
        if shape.depth > self.max_tree_depth:
            raise ValueError(f"tree depth={shape.depth} exceeds what a block of {self.model.block_size} drafts "
                             f"({self.max_tree_depth} positions after the anchor): set the tree depth to at most "
                             f"{self.max_tree_depth}, or evaluate the drafter at a larger block size")
        hidden = self.model.blocks(self.cache, self.anchor[:, None], self.anchor_pos[:, None])  # (B, 1, Bs, H)
        logits = self.model.logits(hidden[:, 0, 1: 1 + shape.depth])             # (B, depth, Vd)

        def feed(tokens, visible, d, parent):                                 # the beams of depth d: (B, k)
            return logits[:, d, None].expand(-1, tokens.shape[1], -1)         # (B, k, Vd) the same for every beam

        self.tree = grow(shape, logits[:, 0], feed, to_target=self.model.draft_to_target)
        return self.tree
