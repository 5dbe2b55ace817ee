"""Token-tree verification on tensors: the greedy longest matching path, lossless multi-candidate rejection sampling.

Shapes: B rows, a tree of N drafted nodes under the root (decoding/tree.py), V vocab. The target scored the tree in
one forward, [root, node 1, ..., node N] with tree attention, so its row i is the distribution of node i's children
(row 0: the root's), and the row of the last accepted node gives the next token.

Sampling: recursive rejection over siblings (SpecInfer's multi-step speculative sampling, Miao et al. 2024, arXiv
2305.09781, Alg. 2 "VerifyStochastic"). At a node u with target distribution p_u, start from the residual r = p_u
and try u's children x_1 .. x_m in order:
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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .sampling import sample, uniform
from .tree import Tree
from .verify import PAD


@dataclass
class TreeVerdict:
    path: torch.Tensor          # (B, D+1) long node ids from the root (0) to the last accepted node, then 0-padded
    num_accepted: torch.Tensor  # (B,) long accepted drafted nodes: the last accepted node's depth
    next_token: torch.Tensor    # (B,) long drawn at the last accepted node (correction, or bonus at a leaf)
    alpha: torch.Tensor         # (B, D) float target mass on the children of the path node at depth d-1 (0 past it)
    tokens: torch.Tensor        # (B, D+1) long accepted drafted tokens, then next_token, then PAD

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1  # (B,)

    @property
    def accepted(self) -> torch.Tensor:
        """(B, D) bool: the path reached depth d+1."""
        D = self.alpha.shape[1]
        return torch.arange(D, device=self.num_accepted.device) < self.num_accepted[:, None]


def _check(tree: Tree, target: torch.Tensor) -> None:
    B, N = tree.tokens.shape
    if target.dim() != 3 or target.shape[:2] != (B, N + 1):
        raise ValueError(f"target scores must be (B, N+1, V) = ({B}, {N + 1}, V) for a tree of {N} nodes, got "
                         f"{tuple(target.shape)}: score [root, node 1..N] in one forward with the tree's attention")


def _finish(tree: Tree, last: torch.Tensor, next_token: torch.Tensor, child_mass: torch.Tensor) -> TreeVerdict:
    """last (B,) the last accepted node, child_mass (B, N+1) the target's mass on each node's children."""
    path, n = tree.path(last)                                                # (B, D+1), (B,)
    D = path.shape[1] - 1
    on = torch.arange(D + 1, device=n.device) <= n[:, None]                  # (B, D+1) path slots in use
    node_tokens = F.pad(tree.tokens, (1, 0), value=PAD)                      # (B, N+1) the root has no draft token
    tokens = torch.where(on, node_tokens.gather(1, path), PAD).roll(-1, dims=1)  # drafted tokens along the path
    tokens.scatter_(1, n[:, None], next_token[:, None])
    alpha = torch.where(on[:, :D], child_mass.gather(1, path[:, :D]), 0.0)   # (B, D)
    return TreeVerdict(path=path * on, num_accepted=n, next_token=next_token, alpha=alpha, tokens=tokens)


def _child_mass(tree: Tree, p_child: torch.Tensor) -> torch.Tensor:
    """(B, N+1): the mass each node puts on its children's tokens, from p_child (B, N) each node's at its parent."""
    B, N = tree.tokens.shape
    return torch.zeros(B, N + 1, device=p_child.device).scatter_add_(1, tree.parents, p_child.float())


def verify_tree_greedy(tree: Tree, target_logits: torch.Tensor) -> TreeVerdict:
    """Accept the longest path whose every token is the target's argmax after its parent; the next token is the
    target's argmax at the path's end. Siblings are distinct tokens, so at most one child of a node matches."""
    _check(tree, target_logits)
    B, N = tree.tokens.shape
    top = target_logits.argmax(-1)                                           # (B, N+1)
    match = tree.tokens == top.gather(1, tree.parents)                       # (B, N)
    ok = torch.ones(B, N + 1, dtype=torch.bool, device=match.device)         # ok[i]: node i and its ancestors match
    for _ in range(tree.max_depth):  # parents come first, so depth passes settle every node
        ok = torch.cat([ok[:, :1], match & ok.gather(1, tree.parents)], dim=1)
    last = torch.where(ok, tree.depths(), -1).argmax(1)                     # (B,) the deepest matching node
    return _finish(tree, last, top.gather(1, last[:, None]).squeeze(1), _child_mass(tree, match))


def verify_tree_sampling(tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                         generator: torch.Generator | None = None) -> TreeVerdict:
    """Recursive rejection over siblings (module docstring): the emitted tokens are distributed exactly as p.

    target_probs p (B, N+1, V), processed (temperature, top-p). draft_probs (B, N+1, V): the q each node's children
    were drawn from, independently (with replacement); None: deterministic children (top-k), q one-hot at each child.
    """
    _check(tree, target_probs)
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
            q = F.one_hot(x, p.shape[-1]).float() if draft_probs is None else draft_probs[rows, cur].float()
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
    return _finish(tree, cur, sample(residual, generator), _child_mass(tree, p_child))
