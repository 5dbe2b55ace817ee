"""Acceptance weights of drafted positions (Draft-OPD, arXiv 2605.29343): how much each position counts in the loss.

reach: position i of a round weighs prod_{j<i} alpha_j, the probability that speculative sampling reaches it (the
       acceptance of every earlier draft); detached. Tokens per target forward = 1 + sum_i prod_{j<=i} alpha_j, so
       this is the weight a position's acceptance has in the speedup.
decay: accepted positions and the first rejected one weigh 1; the k-th position after the first rejection weighs
       decay^k (Draft-OPD's rejected-draft stream, 0.9^(offset-1) with offset 1 = the first rejected).
tree reach (token-tree rollouts, onpolicy/positions.py): a context weighs the probability that verification
       reaches its node, the product of edge (the probability of moving from a node to its child) along its path;
       the chain's reach is the special case of a tree with one child per node.
"""
from __future__ import annotations

import torch

from specdistill.onpolicy.positions import ACCEPTED, AFTER_REJECTION

WEIGHTINGS = ("reach", "decay", "none")


def reach_weights(alpha: torch.Tensor, round_id: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """alpha, round_id, index (P,) -> (P,) prod_{j<i} alpha_j within each round (positions of a round need not be
    contiguous, but every earlier index of a round must be present). Detached."""
    alpha = alpha.detach().float()
    if alpha.numel() == 0:
        return alpha
    R, G = int(round_id.max()) + 1, int(index.max()) + 1
    grid = alpha.new_ones(R, G)                                           # (rounds, gamma), 1 where absent
    grid[round_id, index] = alpha
    reach = torch.cumprod(torch.cat([grid.new_ones(R, 1), grid[:, :-1]], dim=1), dim=1)  # exclusive cumprod
    return reach[round_id, index]


def tree_reach_weights(parent: torch.Tensor, edge: torch.Tensor) -> torch.Tensor:
    """parent (P,) long the position of each context's parent (-1 at a round's root; parents come first), edge (P,)
    the probability of moving from the parent to it (1 at a root) -> (P,) reach[u] = edge[u] * reach[parent[u]], the
    product of edge along u's path. Detached."""
    edge = edge.detach().float()
    reach = edge.clone()
    has_parent = parent >= 0
    src = parent.clamp(min=0)
    for _ in range(int(edge.numel())):  # one more generation per pass; stops once nothing changes
        nxt = torch.where(has_parent, edge * reach[src], edge)
        if torch.equal(nxt, reach):
            break
        reach = nxt
    return reach


def decay_weights(category: torch.Tensor, index: torch.Tensor, round_id: torch.Tensor, decay: float) -> torch.Tensor:
    """(P,) 1 up to and including the first rejection, decay^k for the k-th position after it."""
    out = torch.ones(category.shape, dtype=torch.float, device=category.device)
    after = category == AFTER_REJECTION
    if bool(after.any()):
        R = int(round_id.max()) + 1
        # first rejected index per round = smallest index of the round's non-accepted positions
        first = torch.full((R,), torch.iinfo(torch.long).max, dtype=torch.long, device=index.device)
        first = first.scatter_reduce(0, round_id[category != ACCEPTED], index[category != ACCEPTED], reduce="amin")
        k = (index - first[round_id]).clamp(min=0).float()
        out = torch.where(after, decay ** k, out)
    return out


def position_weights(kind: str, *, alpha, category, round_id, index, decay: float) -> torch.Tensor:
    if kind == "reach":
        return reach_weights(alpha, round_id, index)
    if kind == "decay":
        return decay_weights(category, index, round_id, decay)
    if kind == "none":
        return torch.ones(category.shape, dtype=torch.float, device=category.device)
    raise ValueError(f"unknown weighting {kind!r}; choose one of {WEIGHTINGS}")
