"""Verification on tensors: does the target keep a proposal, and which token comes next. Greedy matching and exact
speculative sampling for chains (Leviathan et al. 2023; Chen et al. 2023), the longest matching path and recursive
rejection over siblings for token trees (SpecInfer, Miao et al. 2024, arXiv 2305.09781, Alg. 2 "VerifyStochastic").

Shapes: B rows, a proposal of N drafted nodes under the root (decoding/tree.py), V vocab. The target scored
[root, node 1, ..., node N] in one forward (a tree: with tree attention), so its row i is the distribution of node
i's children (row 0: the root's), and the row of the last accepted node gives the next token. A chain of K drafts is
the tree whose node i's parent is i-1: row k (k < K) is the distribution of draft k+1, row K the bonus position; it
is verified all positions at once (the fast path), a tree depth by depth.

Tree sampling: at a node u with target distribution p_u, start from the residual r = p_u and try u's children
x_1 .. x_m in order:
    accept x_i with probability min(1, r(x_i) / q_i(x_i))       then continue from x_i with r = p_{x_i};
    else r <- norm(max(0, r - q_i))                             and try x_{i+1};
after the last child is rejected (or at a leaf) the next token is drawn from r.
Here q_i is the proposal x_i was drawn from. Top-k children are deterministic given the draft's context: q_i is
one-hot at x_i, so x_i is accepted with probability r(x_i) and a rejection removes x_i from r (SGLang's target-only
tree sampling does the same).
Proof sketch (one node, by induction over the children): let R_i be the distribution of the token emitted when the
verifier reaches child i with residual r_i. With a one-hot q_i, P(x_i) = r_i(x_i), and for y != x_i
P(y) = (1 - r_i(x_i)) * r_i(y) / (1 - r_i(x_i)) = r_i(y): R_i = r_i. With x_i ~ q_i, the usual speculative sampling
identity min(r, q_i) + (1 - sum min(r, q_i)) * norm(max(0, r - q_i)) = r gives R_i = r_i again. So the token emitted
at u is distributed as r_1 = p_u; given it is an accepted child, the walk continues at that child, whose target row
is the target's distribution given the path so far: every emitted token follows the target, as plain sampling would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .sampling import sample, uniform
from .tree import Proposal

PAD = -1  # fills Verdict.tokens after the next token; never a real token id


@dataclass
class Verdict:
    accepted: torch.Tensor      # (B, D) bool: the accepted path reached depth d+1 (a chain: drafts before the first
    #                             rejection); D = the proposal's depth (a chain: K)
    num_accepted: torch.Tensor  # (B,) long accepted drafts: the last accepted node's depth
    next_token: torch.Tensor    # (B,) long, the correction at the first rejection, or the bonus after the path's end
    alpha: torch.Tensor         # (B, D) float: a chain's sum_x min(p, q) = 1 - TV(p, q) per position (its acceptance
    #                             probability); a tree's target mass on the children of the path node at depth d (0
    #                             past the path)
    tokens: torch.Tensor        # (B, D+1) long, accepted drafts then next_token, then PAD
    path: torch.Tensor | None = None  # trees: (B, D+1) node ids from the root (0) to the last accepted node, 0-padded;
    #                                   None for a chain (its path is nodes 0..num_accepted)

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1  # (B,)


def verify(proposal: Proposal, target_logits: torch.Tensor | None = None, target_probs: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> Verdict:
    """The target's verdict on a proposal, lossless: greedy (target_probs None: accept what equals the target's argmax
    of target_logits (B, N+1, V)), or speculative sampling from target_probs p (B, N+1, V), processed as the draft's
    q (temperature, top-p): the emitted tokens are distributed exactly as p. q is proposal.probs for a chain (None:
    one-hot at the drafts, the greedy drafting policy); a tree's top-k children are one-hot."""
    target = target_logits if target_probs is None else target_probs
    _check(proposal, target)
    if proposal.is_chain:
        if target_probs is None:
            return _chain_greedy(proposal.tokens, target_logits)
        return _chain_sampling(proposal.tokens, proposal.probs, target_probs, generator)
    if target_probs is None:
        return _tree_greedy(proposal, target_logits)
    return _tree_sampling(proposal, target_probs, generator)


def _check(proposal: Proposal, target: torch.Tensor | None) -> None:
    B, N = proposal.tokens.shape
    if target is not None and target.dim() == 3 and target.shape[:2] == (B, N + 1):
        return
    got = None if target is None else tuple(target.shape)
    if proposal.is_chain:
        raise ValueError(f"target scores must be (B, K+1, V) = ({B}, {N + 1}, V) for drafts {(B, N)}, got {got}: "
                         "score [pending, d_1..d_K] in one forward")
    raise ValueError(f"target scores must be (B, N+1, V) = ({B}, {N + 1}, V) for a tree of {N} nodes, got {got}: "
                     "score [root, node 1..N] in one forward with the tree's attention")


# ----------------------------------------------------------------------------------------------- chains (fast path)
def _chain_finish(draft_tokens: torch.Tensor, ok: torch.Tensor, next_of: Callable[[torch.Tensor], torch.Tensor],
            alpha: torch.Tensor) -> Verdict:
    """ok (B, K): per-position accept test -> accepted prefix, counts, and the emitted tokens."""
    accepted = ok.long().cumprod(dim=1).bool()                              # (B, K) True until the first failure
    num_accepted = accepted.sum(1)                                          # (B,)
    next_token = next_of(num_accepted)                                      # (B,)
    tokens = F.pad(torch.where(accepted, draft_tokens, PAD), (0, 1), value=PAD)  # (B, K+1)
    tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return Verdict(accepted, num_accepted, next_token, alpha, tokens)


def _chain_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Accept while the draft equals the target's argmax; the next token is the target's argmax after that."""
    K = draft_tokens.shape[1]
    top = target_logits.argmax(-1)                                          # (B, K+1)
    match = draft_tokens == top[:, :K]                                      # (B, K)
    # Greedy p and q are one-hot: sum_x min(p, q) is 1 when they pick the same token, else 0.
    return _chain_finish(draft_tokens, match, lambda n: top.gather(1, n[:, None]).squeeze(1), match.float())


def _chain_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Speculative sampling: the emitted tokens are distributed exactly as the target's p.

    draft_tokens (B, K) were drawn from draft_probs q (B, K, V); None means a deterministic draft (q one-hot at the
    drafts: the greedy drafting policy, sampling.DRAFT_POLICIES): then d_k is accepted with probability p_k(d_k) and a
    rejection resamples from p_k with d_k removed, renormalised (max(0, p - onehot) below), alpha_k = p_k(d_k).
    target_probs p (B, K+1, V) come from the same temperature / top-p processing as q.
    """
    B, K = draft_tokens.shape
    V = target_probs.shape[-1]
    p = target_probs.float()                                                # (B, K+1, V)
    if draft_probs is None:
        return _chain_sampling_one_hot(draft_tokens, p, generator)
    q = draft_probs.float()                                                 # (B, K, V)
    p_draft = p[:, :K]                                                      # (B, K, V)

    # 1. Accept d_k ~ q_k with probability min(1, p_k(d_k) / q_k(d_k)), all positions at once.
    px = p_draft.gather(-1, draft_tokens[..., None]).squeeze(-1)            # (B, K)
    qx = q.gather(-1, draft_tokens[..., None]).squeeze(-1)                  # (B, K)
    ok = uniform((B, K), generator, p.device) * qx < px                     # u < p/q, and never when p(d) = 0

    # 2. The next token, at n = number accepted: resample from norm(max(0, p_n - q_n)) after a rejection,
    #    or draw the bonus from p_K when all K were accepted (q_K = 0 makes the same formula give p_K).
    def next_of(n: torch.Tensor) -> torch.Tensor:
        p_n = p.gather(1, n[:, None, None].expand(B, 1, V)).squeeze(1)     # (B, V)
        q_n = torch.zeros_like(p_n)
        if K > 0:
            q_n = q.gather(1, n.clamp(max=K - 1)[:, None, None].expand(B, 1, V)).squeeze(1)
            q_n = q_n * (n < K)[:, None]
        residual = (p_n - q_n).clamp(min=0)                                 # (B, V), normalized by sample()
        # p == q leaves no residual mass; a rejection there is a rounding artifact: p is the residual's limit.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
        return sample(residual, generator)

    alpha = torch.minimum(p_draft, q).sum(-1)                               # (B, K)
    return _chain_finish(draft_tokens, ok, next_of, alpha)


def _chain_sampling_one_hot(draft_tokens: torch.Tensor, p: torch.Tensor,
                            generator: torch.Generator | None) -> Verdict:
    """_chain_sampling with q one-hot at the drafts (the greedy drafting policy), without building q (B, K, V):
    qx = 1, so d_k is accepted when u < p_k(d_k); the residual max(0, p_n - onehot(d_n)) is p_n with d_n's entry
    zeroed (p <= 1); alpha_k = sum_x min(p_k, onehot(d_k)) = p_k(d_k). The same values, draws included, as the
    general path given the one-hot q. draft_tokens (B, K), p (B, K+1, V) fp32."""
    B, K = draft_tokens.shape
    V = p.shape[-1]
    px = p[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)           # (B, K)
    ok = uniform((B, K), generator, p.device) < px

    def next_of(n: torch.Tensor) -> torch.Tensor:
        p_n = p.gather(1, n[:, None, None].expand(B, 1, V)).squeeze(1)     # (B, V)
        residual = p_n
        if K > 0:
            rejected = draft_tokens.gather(1, n.clamp(max=K - 1)[:, None])   # (B, 1) d_n (kept where n = K)
            residual = p_n.scatter(1, rejected, torch.where((n < K)[:, None], 0.0, p_n.gather(1, rejected)))
        # p_n(d_n) = 1 leaves no residual mass; a rejection there is a rounding artifact: p is the residual's limit
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
        return sample(residual, generator)

    return _chain_finish(draft_tokens, ok, next_of, px)


# ----------------------------------------------------------------------------------------------- trees
def _tree_finish(tree: Proposal, last: torch.Tensor, next_token: torch.Tensor, child_mass: torch.Tensor) -> Verdict:
    """last (B,) the last accepted node, child_mass (B, N+1) the target's mass on each node's children."""
    path, n = tree.path(last)                                                # (B, D+1), (B,)
    D = path.shape[1] - 1
    on = torch.arange(D + 1, device=n.device) <= n[:, None]                  # (B, D+1) path slots in use
    node_tokens = F.pad(tree.tokens, (1, 0), value=PAD)                      # (B, N+1) the root has no draft token
    tokens = torch.where(on, node_tokens.gather(1, path), PAD).roll(-1, dims=1)  # drafted tokens along the path
    tokens.scatter_(1, n[:, None], next_token[:, None])
    alpha = torch.where(on[:, :D], child_mass.gather(1, path[:, :D]), 0.0)   # (B, D)
    accepted = torch.arange(D, device=n.device) < n[:, None]                  # (B, D) the path reached depth d+1
    return Verdict(accepted=accepted, num_accepted=n, next_token=next_token, alpha=alpha, tokens=tokens,
                   path=path * on)


def _child_mass(tree: Proposal, p_child: torch.Tensor) -> torch.Tensor:
    """(B, N+1): the mass each node puts on its children's tokens, from p_child (B, N) each node's at its parent."""
    B, N = tree.tokens.shape
    return torch.zeros(B, N + 1, device=p_child.device).scatter_add_(1, tree.parents, p_child.float())


def _tree_greedy(tree: Proposal, target_logits: torch.Tensor) -> Verdict:
    """Accept the longest path whose every token is the target's argmax after its parent; the next token is the
    target's argmax at the path's end. Siblings are distinct tokens, so at most one child of a node matches."""
    B, N = tree.tokens.shape
    top = target_logits.argmax(-1)                                           # (B, N+1)
    match = tree.tokens == top.gather(1, tree.parents)                       # (B, N)
    ok = torch.ones(B, N + 1, dtype=torch.bool, device=match.device)         # ok[i]: node i and its ancestors match
    for _ in range(tree.max_depth):  # parents come first, so depth passes settle every node
        ok = torch.cat([ok[:, :1], match & ok.gather(1, tree.parents)], dim=1)
    last = torch.where(ok, tree.depths(), -1).argmax(1)                     # (B,) the deepest matching node
    return _tree_finish(tree, last, top.gather(1, last[:, None]).squeeze(1), _child_mass(tree, match))


def _tree_sampling(tree: Proposal, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
    """Recursive rejection over siblings (module docstring): the emitted tokens are distributed exactly as p.

    target_probs p (B, N+1, V), processed (temperature, top-p). tree.probs (B, N, V): the q each node was drawn from
    at its parent, siblings independently (with replacement); None: deterministic children (top-k), q one-hot.
    """
    B, N = tree.tokens.shape
    device = target_probs.device
    p = target_probs.float()
    rows = torch.arange(B, device=device)
    children = tree.children()                                               # (B, N+1, k)
    node_tokens = F.pad(tree.tokens, (1, 0))                                 # (B, N+1)
    cur = torch.zeros(B, dtype=torch.long, device=device)                    # the last accepted node
    walking = torch.ones(B, dtype=torch.bool, device=device)                 # rows whose last step accepted a child
    residual = p[:, 0]                                                       # (B, V)
    for _ in range(tree.max_depth):
        kids = children[rows, cur]                                           # (B, k)
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        for j in range(kids.shape[1]):
            child = kids[:, j]                                               # (B,) node id or -1
            trying = walking & ~moved & (child > 0)
            x = node_tokens.gather(1, child.clamp(min=0)[:, None]).squeeze(1)  # (B,)
            q = (F.one_hot(x, p.shape[-1]).float() if tree.probs is None
                 else tree.probs[rows, (child - 1).clamp(min=0)].float())             # (B, V) x's proposal
            r = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)  # (B, V) normalised
            rx, qx = r.gather(1, x[:, None]).squeeze(1), q.gather(1, x[:, None]).squeeze(1)
            accept = trying & (uniform((B,), generator, device) * qx < rx)  # u < r(x)/q(x), never when r(x) = 0
            reject = trying & ~accept
            residual = torch.where(reject[:, None], (r - q).clamp(min=0), residual)
            residual = torch.where(accept[:, None], p[rows, child.clamp(min=0)], residual)
            cur = torch.where(accept, child, cur)
            moved |= accept
        walking &= moved
    # r == q leaves no residual mass; a rejection there is a rounding artifact: p is the residual's limit.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, cur])
    V = p.shape[-1]
    p_child = p.flatten(1).gather(1, tree.parents * V + tree.tokens)        # (B, N) each node's p at its parent
    return _tree_finish(tree, cur, sample(residual, generator), _child_mass(tree, p_child))
