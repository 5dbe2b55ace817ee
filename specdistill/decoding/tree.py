"""A round's proposal: a token tree, of which a chain is the width-1 case. Shapes (what to propose), EAGLE-2
expansion (Li et al. 2024, arXiv 2406.16858) by cumulative draft probability, and what the target needs to score a
proposal in one forward (attention among ancestors, positions by depth). Knows nothing of models or caches: a drafter
supplies the draft's logits through a callback.

A proposal hangs under its root, node 0: the pending token, which both models have not fed yet. Nodes 1..N are drafted
tokens, ordered by depth (a parent always comes before its children) and, among nodes of one depth, by score. A chain
(topk=1) is node i's parent i-1: it stores no parents, and the target scores it with plain causal attention.

Expansion, for TreeShape(topk, depth, nodes):
  depth 1   the root's topk most probable children; they are the beams.
  depth d   each of the topk beams of depth d-1 is fed to the draft (tree attention: it sees its ancestors) and its
            topk children are scored by cumulative log-probability, log q(path); the topk best of these topk^2
            become the beams of depth d.
  keep      nodes=None: every scored node, topk + (depth-1) * topk^2 of them (a fixed shape every round);
            nodes=N: the N best-scored nodes (EAGLE-2's rerank). A child's score is at most its parent's, so the N
            best always form a tree (ties go to the shallower node).
SGLang serves the same expansion with --speculative-eagle-topk=topk, --speculative-num-steps=depth and
--speculative-num-draft-tokens=nodes+1 (it counts the root); TreeShape.sglang_flags() names them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_TREE_NODES = 256  # a verify forward over more tokens than this is a prefill, not a decode step


@dataclass(frozen=True)
class TreeShape:
    """What a round proposes (see the module docstring). topk=1 is a chain of up to `depth` drafts, drawn by the
    drafting sampler (sampled or argmax; a drafter may stop it early); topk > 1 grows a tree of top-k children.

    As a decoding strategy (generate.Strategy) a shape proposes itself every round, cut to the token budget."""

    topk: int = 4            # children scored per beam, and beams kept per depth
    depth: int = 4           # draft steps: the deepest node's depth (0: an empty chain, the round is a target step)
    nodes: int | None = None  # drafted nodes kept (best by cumulative probability); None: every scored node

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ValueError(f"tree topk={self.topk} must be >= 1 (children per beam; topk=1 is a chain)")
        if self.depth < (0 if self.topk == 1 else 1):
            raise ValueError(f"tree depth={self.depth} must be >= 1 (draft steps per round)")
        if self.nodes is not None and self.nodes < 1:
            raise ValueError(f"tree nodes={self.nodes} must be >= 1, or None to keep every scored node")
        if self.nodes is not None and self.nodes > self.scored:
            raise ValueError(f"tree nodes={self.nodes} exceeds the {self.scored} nodes that topk={self.topk}, "
                             f"depth={self.depth} score (topk + (depth-1) * topk^2): lower nodes or raise topk / depth")
        if self.size > MAX_TREE_NODES:
            raise ValueError(f"a tree of {self.size} nodes (topk={self.topk}, depth={self.depth}, nodes={self.nodes}) "
                             f"exceeds {MAX_TREE_NODES}: set nodes=N to keep the N best, or lower topk / depth")

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """A chain of up to k drafts (k >= 0)."""
        return cls(topk=1, depth=k)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def scored(self) -> int:
        """Nodes the expansion scores: topk at depth 1, topk^2 at each deeper step."""
        return self.topk + (self.depth - 1) * self.topk ** 2

    @property
    def size(self) -> int:
        """Drafted nodes per round, the root excluded: the target verifies size + 1 tokens."""
        return self.scored if self.nodes is None else self.nodes

    @property
    def max_depth(self) -> int:
        """The deepest any kept node can be: a best-N tree of N < depth nodes is at most N deep."""
        return self.depth if self.nodes is None else min(self.depth, self.nodes)

    def at_most(self, depth: int) -> TreeShape:
        """This shape cut to `depth` draft steps (>= 1): a round near the token budget drafts no deeper than it."""
        if depth >= self.depth:
            return self
        cut = TreeShape(self.topk, depth)
        return cut if self.nodes is None or self.nodes >= cut.scored else TreeShape(self.topk, depth, self.nodes)

    # Strategy (generate.py): the same shape every round, no deeper than the budget (the token after the deepest node
    # comes free), and nothing learned from the rounds.
    @property
    def max_shape(self) -> TreeShape:
        return self

    def next_shape(self, remaining: int) -> TreeShape:
        return self.at_most(max(min(self.max_depth, remaining - 1), 1))

    adapts = False  # update() learns nothing: the decoding loop need not bring the round's acceptance to the host

    def update(self, proposed: int, accepted: int) -> None:
        pass

    def sglang_flags(self) -> dict[str, int]:
        """The SGLang server flags that serve this shape (num-draft-tokens counts the root)."""
        return {"--speculative-eagle-topk": self.topk, "--speculative-num-steps": self.depth,
                "--speculative-num-draft-tokens": self.size + 1}

    @property
    def name(self) -> str:
        return f"tree{self.topk}x{self.depth}" + ("" if self.nodes is None else f"n{self.nodes}")


@dataclass
class Proposal:
    """B proposals of N drafted nodes each under the root (node 0, the pending token, is not stored). parents None: a
    chain, node i's parent is node i-1 (depth i); trees (tree.grow) fill parents, depth, score and fed."""

    tokens: torch.Tensor                   # (B, N) long, target vocabulary ids of nodes 1..N
    probs: torch.Tensor | None = None      # (B, N, V) chains: the q each draft was drawn from; None: one-hot at tokens
    parents: torch.Tensor | None = None    # (B, N) long, parent node of nodes 1..N, in 0..N-1 (0 = root), < the node
    depth: torch.Tensor | None = None      # (B, N) long, 1 for the root's children
    score: torch.Tensor | None = None      # (B, N) float, cumulative draft log-probability of the path to the node
    fed: torch.Tensor | None = None        # (B, N) long, order in which the draft was fed the node (a beam), -1: never
    topk: int = 1                          # most children any node has

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def to(self, device: torch.device) -> Proposal:
        """This proposal on `device` (itself when it is there already)."""
        if self.tokens.device == device:
            return self
        move = {k: getattr(self, k) for k in ("tokens", "probs", "parents", "depth", "score", "fed")}
        return dataclasses.replace(self, **{k: None if v is None else v.to(device) for k, v in move.items()})

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @functools.cached_property
    def max_depth(self) -> int:
        """The deepest node's depth (a tree: one host sync, then cached; the proposal is not changed after grow())."""
        if self.is_chain or not self.num_nodes:
            return self.num_nodes
        return int(self.depth.max())

    def parent_ids(self) -> torch.Tensor:
        """(B, N) parents, a chain's included."""
        if not self.is_chain:
            return self.parents
        return torch.arange(self.num_nodes, device=self.tokens.device).expand_as(self.tokens)

    def depths(self) -> torch.Tensor:
        """(B, N+1) depth of every node, the root's 0 included: the offset of its position id."""
        if self.is_chain:
            return torch.arange(self.num_nodes + 1, device=self.tokens.device).expand(self.tokens.shape[0], -1)
        return torch.cat([torch.zeros_like(self.depth[:, :1]), self.depth], dim=1)

    def ancestors(self) -> torch.Tensor:
        """(B, N+1, N+1) bool: [b, i, j] is True when node j is node i or one of its ancestors (the root is everyone's):
        the tree attention mask, node i attends to exactly these (a chain's: causal)."""
        B, N = self.tokens.shape
        if self.is_chain:
            return torch.ones(N + 1, N + 1, dtype=torch.bool, device=self.tokens.device).tril().expand(B, -1, -1)
        eye = torch.eye(N + 1, dtype=torch.bool, device=self.tokens.device).expand(B, -1, -1)
        parent = torch.cat([torch.zeros_like(self.parents[:, :1]), self.parents], dim=1)   # (B, N+1) root -> itself
        seen = eye.clone()
        for _ in range(self.max_depth):  # seen[i] |= seen[parent(i)]: one more generation per pass
            seen = seen | seen.gather(1, parent[..., None].expand(-1, -1, N + 1))
        return seen

    def attention(self, start: torch.Tensor) -> dict[str, torch.Tensor]:
        """What BatchKV.step needs to score [root, nodes] from committed lengths start (B,): nothing for a chain
        (causal, consecutive positions), positions by depth and the ancestor mask for a tree."""
        if self.is_chain:
            return {}
        return {"positions": start[:, None] + self.depths().to(start.device),
                "tail_visible": self.ancestors().to(start.device)}

    def children(self) -> torch.Tensor:
        """(B, N+1, topk) long: the children of every node in node order (best-scored first), padded with -1."""
        B, N = self.tokens.shape
        device = self.tokens.device
        parents = self.parent_ids()
        nodes = torch.arange(1, N + 1, device=device).expand(B, -1)         # (B, N)
        # A child's rank among its siblings: siblings come before it in node order.
        same = parents[:, :, None] == parents[:, None, :]                   # (B, N, N)
        rank = (same & torch.ones(N, N, dtype=torch.bool, device=device).tril(-1)).sum(2)  # (B, N)
        out = torch.full((B, N + 1, self.topk + 1), -1, dtype=torch.long, device=device)   # last slot: trash
        out[torch.arange(B, device=device)[:, None], parents, rank.clamp(max=self.topk)] = nodes
        return out[..., : self.topk]

    def path(self, node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """node (B,) -> (B, D+1) the nodes from the root to it (by depth, then 0-padded) and its depth (B,)."""
        B, N = self.tokens.shape
        D = self.max_depth
        on_path = self.ancestors()[torch.arange(B, device=node.device), node]          # (B, N+1)
        depths = self.depths()
        col = torch.where(on_path, depths, D + 1)                                       # (B, N+1), trash col D+1
        out = torch.zeros(B, D + 2, dtype=torch.long, device=node.device)
        out.scatter_(1, col, torch.arange(N + 1, device=node.device).expand(B, -1))
        return out[:, : D + 1], depths.gather(1, node[:, None]).squeeze(1)

    def contexts(self) -> torch.Tensor:
        """(B, C) long: the root (0) and every node with a child, in node order, padded with -1: where the draft
        proposed children (a chain's: nodes 0..N-1)."""
        B, N = self.tokens.shape
        has_child = torch.zeros(B, N + 1, dtype=torch.bool, device=self.tokens.device)
        has_child.scatter_(1, self.parent_ids(), True)
        has_child[:, 0] = True
        C = int(has_child.sum(1).max())
        order = torch.sort((~has_child).int(), dim=1, stable=True).indices[:, :C]      # context nodes first, in order
        return torch.where(has_child.gather(1, order), order, -1)

    def node_prob(self, logits: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """(B, N) the target's probability of each node's token at its parent: logits (B, N+1, V) of [root, nodes];
        probs the processed distribution (B, N+1, V), or None for greedy decoding (then 1.0 at the argmax, else 0)."""
        parents, tokens = self.parent_ids().to(logits.device), self.tokens.to(logits.device)
        if probs is None:
            return (logits.argmax(-1).gather(1, parents) == tokens).float()
        V = probs.shape[-1]
        return probs.flatten(1).gather(1, parents * V + tokens).float()


# Feed callback of grow(): the beams of one depth d >= 1 (B, k) target ids; which of the fed beams each sees (B, k, F)
# over every beam fed so far, these last (the tree attention among drafted nodes); d; and each beam's parent (B, k)
# among the beams fed at depth d-1 (0 at depth 1: the root) -> the draft's logits after each beam (B, k, Vd).
Feed = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


def _identity(ids: torch.Tensor) -> torch.Tensor:
    return ids


@torch.no_grad()
def grow(shape: TreeShape, root_logits: torch.Tensor, feed: Feed,
         to_target: Callable[[torch.Tensor], torch.Tensor] = _identity) -> Proposal:
    """EAGLE-2 expansion (module docstring) from the draft's logits after the root, root_logits (B, Vd).

    to_target maps draft-vocabulary ids to the target's (a vocab-restricted head); feed() gets target ids."""
    B, Vd = root_logits.shape
    k = shape.topk
    if k > Vd:
        raise ValueError(f"tree topk={k} exceeds the draft's vocabulary of {Vd} tokens")
    device = root_logits.device
    rows = torch.arange(B, device=device)[:, None]
    # The candidate pool, in scoring order (depth by depth): id c >= 1 is pool column c-1; 0 is the root.
    score, draft_ids = root_logits.float().log_softmax(-1).topk(k, dim=-1)             # (B, k)
    tokens = [to_target(draft_ids)]
    parents = [torch.zeros(B, k, dtype=torch.long, device=device)]
    depth = [torch.ones(B, k, dtype=torch.long, device=device)]
    scores = [score]
    beams = torch.arange(1, k + 1, device=device).expand(B, -1)                         # (B, k) pool ids
    beam_parent = torch.zeros(B, k, dtype=torch.long, device=device)                    # (B, k) in the last beams
    beam_score = score
    fed_ids: list[torch.Tensor] = []                                                    # pool ids of fed beams
    seen_pool = torch.zeros(B, 1 + shape.scored, 1 + shape.scored, dtype=torch.bool, device=device)
    seen_pool[:, :, 0] = True                                                           # everyone sees the root
    seen_pool[:, 1: k + 1, 1: k + 1] = torch.eye(k, dtype=torch.bool, device=device)
    size = k
    for d in range(1, shape.depth):
        # 1. Feed the beams of depth d: each sees the fed beams among its ancestors, and itself.
        fed_ids.append(beams)
        fed = torch.cat(fed_ids, dim=1)                                                 # (B, F)
        visible = seen_pool[rows[..., None], beams[..., None], fed[:, None, :]]            # (B, k, F)
        logits = feed(torch.cat(tokens, 1).gather(1, beams - 1), visible, d, beam_parent)           # (B, k, Vd)
        logp = logits.float().log_softmax(-1)
        # 2. Score every beam's topk children by cumulative log-probability; the topk best become the next beams.
        child_logp, child_ids = logp.topk(k, dim=-1)                                    # (B, k, k)
        child_score = (beam_score[..., None] + child_logp).reshape(B, k * k)            # (B, k^2)
        child_parent = beams[..., None].expand(-1, -1, k).reshape(B, k * k)
        new = torch.arange(size + 1, size + k * k + 1, device=device).expand(B, -1)     # (B, k^2) pool ids
        tokens.append(to_target(child_ids.reshape(B, k * k)))
        parents.append(child_parent)
        depth.append(torch.full((B, k * k), d + 1, dtype=torch.long, device=device))
        scores.append(child_score)
        # A child sees what its parent sees, and itself.
        seen_pool[rows, new] = seen_pool[rows, child_parent]
        seen_pool[rows, new, new] = True
        beam_score, best = child_score.topk(k, dim=-1)                                  # (B, k)
        beams, beam_parent = new.gather(1, best), best // k
        size += k * k
    pool_fed = torch.full((B, 1 + size), -1, dtype=torch.long, device=device)
    if fed_ids:
        fed = torch.cat(fed_ids, dim=1)
        pool_fed.scatter_(1, fed, torch.arange(fed.shape[1], device=device).expand(B, -1))
    return _keep(shape, torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(depth, 1), torch.cat(scores, 1),
                 pool_fed[:, 1:])


def _keep(shape: TreeShape, tokens, parents, depth, score, fed) -> Proposal:
    """Pool (B, P) -> the kept nodes (all, or the N best by score), renumbered by depth then score."""
    B, P = tokens.shape
    device = tokens.device
    if shape.nodes is None:
        keep = torch.arange(P, device=device).expand(B, -1)                             # (B, P) pool columns
    else:
        # The pool is in depth order and the sort is stable: ties keep the shallower node, so parents stay in.
        keep = torch.sort(score, dim=1, descending=True, stable=True).indices[:, : shape.nodes]
    # Node order: by depth, then by score (best first).
    s, dep = score.gather(1, keep), depth.gather(1, keep)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices
    order = order.gather(1, torch.sort(dep.gather(1, order), dim=1, stable=True).indices)
    keep = keep.gather(1, order)                                                        # (B, N) pool columns
    N = keep.shape[1]
    # Renumber parents: pool id (column + 1) -> node id; the root stays 0.
    node_of = torch.zeros(B, P + 1, dtype=torch.long, device=device)
    node_of.scatter_(1, keep + 1, torch.arange(1, N + 1, device=device).expand(B, -1))
    new_parents = node_of.gather(1, parents.gather(1, keep))
    return Proposal(tokens=tokens.gather(1, keep), parents=new_parents, depth=depth.gather(1, keep),
                score=score.gather(1, keep), fed=fed.gather(1, keep), topk=shape.topk)
