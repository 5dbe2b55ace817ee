"""The cost model's search over token-tree shapes: one probe decode with a wide tree, then the tau of every candidate
shape predicted by replaying its expansion (EAGLE-2: decoding/tree.py) on the probe's trees. Knows nothing of
models: it reads the RoundRecords of tree decodes (decoding/generate.py) and takes costs as numbers.

The probe decodes a few prompts with TreeShape(4, D): every scored node kept, 4 + (D-1) * 16 of them. For each of its
rounds (M row-rounds) and node u it knows u's cumulative draft score, its parent, its children (the probe's beams
have 4, ranked by score, other nodes none) and node_prob(u), the target's probability of u's token at its parent.
Recursive rejection over top-k children accepts child x with probability p(x) (decoding/verify.py), so verification
reaches u with probability R(u) = prod of node_prob along u's path (0 or 1 at temperature 0), and a tree T accepts
E[n] = sum_{u in T} R(u) drafted tokens per round: tau(T) = 1 + the mean of that sum over the probe's rounds.

A candidate TreeShape(k, d, N), k <= 4, d <= D, is replayed on each probe tree: its depth-1 nodes are the root's k
best children; each depth's k beams (the best-scored of the k^2 children of the last beams) get their k best
children; the pool of depth <= d keeps its N best scores (ties: the shallower). With k = 4 the candidate's pool is
the probe's own, exactly; with k < 4 a candidate beam that was no probe beam has no recorded children: those nodes
are missing, counted as rejected (coverage reports the share of the candidate's scored nodes the probe held).
The contexts are the probe's rounds: its round boundaries, not the candidate's (at temperature 0 both follow the
target's own greedy output).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdistill.decoding.tree import TreeShape
from specdistill.decoding.generate import RoundRecord
from specdistill.eval.tree_cost import Setting, VerifyCurve

MAX_TOPK = 4  # the probe's width, and the widest candidate


@dataclass
class ProbeTrees:
    """The probe's full-shape row-rounds (rounds cut short near the token budget are left out)."""

    shape: TreeShape
    score: torch.Tensor     # (M, P+1) cumulative draft log-probability of node 0 (the root: 0) .. P
    reach: torch.Tensor     # (M, P+1) probability that verification reaches the node (the root: 1)
    children: torch.Tensor  # (M, P+1, topk) long the node's children by score, -1 where none

    @property
    def rounds(self) -> int:
        return self.score.shape[0]


def probe_trees(shape: TreeShape, rounds: list[RoundRecord]) -> ProbeTrees | None:
    """The full-shape rounds of probe decodes with `shape` (their RoundRecords), active rows only; None when every round
    was cut short (a budget of max_new_tokens <= the probe's depth)."""
    score, reach, children = [], [], []
    for r in rounds:
        tree = r.proposal
        if tree is None or tree.is_chain or tree.num_nodes != shape.size or tree.max_depth != shape.max_depth:
            continue
        rows = r.active.to(tree.tokens.device).nonzero().flatten()
        if rows.numel() == 0:
            continue
        prob = r.node_prob.to(tree.tokens.device)                                       # (B, N)
        R = torch.ones(prob.shape[0], tree.num_nodes + 1, device=prob.device)           # (B, N+1)
        for _ in range(tree.max_depth):  # parents come first: depth passes settle every node
            R = torch.cat([R[:, :1], prob * R.gather(1, tree.parents)], dim=1)
        score.append(torch.nn.functional.pad(tree.score.float(), (1, 0))[rows])
        reach.append(R[rows])
        children.append(tree.children()[rows])
    if not score:
        return None
    return ProbeTrees(shape, torch.cat(score).cpu(), torch.cat(reach).cpu(), torch.cat(children).cpu())


@dataclass
class Replay:
    """A candidate topk's expansion replayed on the probe's trees, its pool in scoring order (depth by depth)."""

    topk: int
    score: torch.Tensor    # (M, Q) the pool's scores, -inf where missing; Q = k + (D-1) k^2
    reach: torch.Tensor    # (M, Q) 0 where missing
    present: torch.Tensor  # (M, Q) bool: the probe held the node

    def pool(self, depth: int) -> int:
        """Scored nodes of depth <= `depth`: k + (depth-1) k^2."""
        return self.topk + (depth - 1) * self.topk ** 2

    def accepted(self, depth: int) -> torch.Tensor:
        """(pool(depth),) expected accepted drafts per round of the trees keeping the N = 1 .. pool best nodes."""
        Q = self.pool(depth)
        order = torch.sort(self.score[:, :Q], dim=1, descending=True, stable=True).indices   # ties: the shallower
        return self.reach[:, :Q].gather(1, order).cumsum(1).mean(0)

    def coverage(self, depth: int) -> float:
        return float(self.present[:, : self.pool(depth)].float().mean())


def replay(probe: ProbeTrees, k: int) -> Replay:
    """The expansion of TreeShape(k, D) on every probe tree (module docstring)."""
    if not 1 <= k <= probe.shape.topk:
        raise ValueError(f"candidate topk={k} must be within 1..{probe.shape.topk}, the probe's width")
    M = probe.rounds
    rows = torch.arange(M)[:, None]
    kids = probe.children[..., :k]                                                    # (M, P+1, k) best first
    beams = kids[:, 0]                                                                # (M, k) the root's
    pool = [beams]
    for _ in range(1, probe.shape.depth):
        c = torch.where(beams[..., None] >= 0, kids[rows, beams.clamp(min=0)], -1).reshape(M, k * k)  # (M, k^2)
        pool.append(c)
        s = torch.where(c >= 0, probe.score.gather(1, c.clamp(min=0)), -torch.inf)
        beams = c.gather(1, s.topk(k, dim=1).indices)
    ids = torch.cat(pool, dim=1)                                                      # (M, Q)
    present = ids >= 0
    score = torch.where(present, probe.score.gather(1, ids.clamp(min=0)), -torch.inf)
    reach = torch.where(present, probe.reach.gather(1, ids.clamp(min=0)), 0.0)
    return Replay(k, score, reach, present)


def tree_settings(probe: ProbeTrees, draft: Callable[[int, int], float], curve: VerifyCurve, overhead: float,
                  baseline: float) -> list[Setting]:
    """For every topk 1..4 and depth 1..D, the node count N (nodes + 1 <= the curve's widest) of highest predicted
    speed. draft(topk, depth): a round's draft cost in target steps; overhead, baseline: Setting's."""
    out = []
    for k in range(1, probe.shape.topk + 1):
        rep = replay(probe, k)
        for d in range(1, probe.shape.depth + 1):
            accepted = rep.accepted(d)
            top = min(rep.pool(d), len(curve.ms) - 1)
            options = []
            for n in range(1, top + 1):
                shape = TreeShape(k, d, None if n == rep.pool(d) else n)
                options.append(Setting(shape.name, 1.0 + float(accepted[n - 1]), draft(k, d), n + 1, curve.v(n + 1),
                                       flags=shape.sglang_flags(), overhead=overhead, baseline=baseline, shape=shape,
                                       coverage=rep.coverage(d)))
            out.append(max(options, key=lambda s: s.predicted_speedup))
    return out
