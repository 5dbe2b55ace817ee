"""Replay of the positions verification rejected (Draft-OPD, arXiv 2605.29343; OSD, arXiv 2310.07177).

A bounded buffer of drafted positions the draft got wrong, each stored with its context tokens and the target's
logits there (cached: replaying never runs the target again). Priority = 1 - alpha, how badly the draft missed
(alpha = sum_x min(p, q)); replayed positions are re-scored by the current draft and their priority updated, so a
position the draft has learned sinks. Items older than max_age (in rollout refreshes) are dropped; when full, the
lowest-priority items go first (ties: the oldest).

EAGLE-3 heads draft from the target's features, so their items also hold `aux`, the target's aux hidden states over
the item's trajectory (L, n_aux * Ht), ONE tensor shared by every item of that trajectory (memory: per rollout
refresh, rows x length x n_aux * Ht floats, freed when its last item leaves), and `index`, the draft's step within
its round (the head reads slot len(context) - index - 2 at unroll step index).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specdistill.onpolicy.positions import TargetLogits


@dataclass
class ReplayItem:
    uid: int
    context: torch.Tensor    # (L,) long: the draft predicts the token after it
    target: TargetLogits     # one position: values (1, V) or top-k (1, k)
    priority: float          # 1 - alpha when last scored
    born: int                # rollout refresh that produced it
    aux: Optional[torch.Tensor] = None  # EAGLE-3: (L, n_aux * Ht) the target's features on the item's trajectory
    index: int = 0           # EAGLE-3: the draft's step within its round


class ReplayBuffer:
    def __init__(self, capacity: int, max_age: Optional[int] = None):
        if capacity < 1:
            raise ValueError(f"replay capacity must be >= 1, got {capacity}")
        if max_age is not None and max_age < 0:
            raise ValueError(f"replay max_age must be >= 0 (or null for no limit), got {max_age}")
        self.capacity, self.max_age = capacity, max_age
        self.items: dict[int, ReplayItem] = {}
        self._next_uid = 0
        self.evicted = 0   # dropped for capacity
        self.expired = 0   # dropped for staleness

    def __len__(self) -> int:
        return len(self.items)

    def priorities(self) -> torch.Tensor:
        return torch.tensor([it.priority for it in self.items.values()], dtype=torch.float)

    def expire(self, now: int) -> None:
        """Drop items collected more than max_age refreshes before `now`."""
        if self.max_age is None:
            return
        stale = [u for u, it in self.items.items() if now - it.born > self.max_age]
        for u in stale:
            del self.items[u]
        self.expired += len(stale)

    def add(self, contexts: list[torch.Tensor], targets: TargetLogits, priorities: torch.Tensor, now: int,
            aux: Optional[list[torch.Tensor]] = None, index: Optional[list[int]] = None) -> None:
        """Insert positions (contexts, their target logits, priorities (N,); EAGLE-3: aux and index per position);
        then enforce max_age and capacity."""
        if not (len(contexts) == len(targets) == len(priorities)):
            raise ValueError("contexts, targets and priorities must have the same length")
        if (aux is None) != (index is None) or (aux is not None and not len(aux) == len(index) == len(contexts)):
            raise ValueError("EAGLE-3 items need both aux and index, one per context")
        for k, (ctx, pr) in enumerate(zip(contexts, priorities.tolist())):
            idx = torch.tensor([k], device=targets.values.device)
            self.items[self._next_uid] = ReplayItem(self._next_uid, ctx.detach(), targets.select(idx), float(pr), now,
                                                    None if aux is None else aux[k], 0 if index is None else index[k])
            self._next_uid += 1
        self.expire(now)
        over = len(self.items) - self.capacity
        if over > 0:
            # lowest priority first; among equals the oldest (smallest uid)
            order = sorted(self.items.values(), key=lambda it: (it.priority, it.uid))
            for it in order[:over]:
                del self.items[it.uid]
            self.evicted += over

    def sample(self, n: int, now: int) -> list[ReplayItem]:
        """The n highest-priority items that are not stale (ties: the newest), highest first."""
        self.expire(now)
        if n <= 0:
            return []
        order = sorted(self.items.values(), key=lambda it: (-it.priority, -it.uid))
        return order[:n]

    def update(self, uids: list[int], priorities: torch.Tensor) -> None:
        """New priorities after re-scoring with the current draft (items evicted meanwhile are skipped)."""
        for u, pr in zip(uids, priorities.tolist()):
            if u in self.items:
                self.items[u].priority = float(pr)


def pack_prefixes(contexts: list[torch.Tensor], keys: Optional[list] = None) -> tuple[list[torch.Tensor], list[int]]:
    """Rows that hold every context as a prefix, and each context's row: (rows, row_of (N,)). Rejected positions of
    one rollout row all lie on its trajectory, so their contexts are prefixes of one another and share ONE draft row
    (the draft's logits after a prefix of a row are those after the prefix alone: causal attention). With keys, only
    contexts of equal keys share a row (EAGLE-3: the same trajectory's features). Greedy, longest first; O(N * rows)
    prefix comparisons, small next to the draft forward it saves."""
    order = sorted(range(len(contexts)), key=lambda k: -len(contexts[k]))
    rows: list[torch.Tensor] = []
    row_keys: list = []
    row_of = [0] * len(contexts)
    for k in order:
        c, key = contexts[k], None if keys is None else keys[k]
        for r, row in enumerate(rows):
            if row_keys[r] == key and len(row) >= len(c) and torch.equal(row[: len(c)], c):
                row_of[k] = r
                break
        else:
            row_of[k] = len(rows)
            rows.append(c)
            row_keys.append(key)
    return rows, row_of
