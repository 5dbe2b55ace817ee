"""The processes of one launch: how long they wait for each other, and how they split work between them.

Knows nothing about models or data: build.py fills the caches under caches_filled_once and hands regeneration
(pipeline/regenerate.py) a share of the store's parts; the final evaluation splits its prompts with eval/merge.shares.
"""
from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence


def process_group_timeout(seconds: float) -> timedelta:
    """How long a collective may wait for the slowest rank (trainer.process_group_timeout_s, passed by the caller):
    it must cover the longest stretch one rank works while the others wait (a rank's share of the regeneration, the
    final evaluation, a checkpoint), not torch's 10 or 30 minutes."""
    return timedelta(seconds=float(seconds))


@contextlib.contextmanager
def caches_filled_once(acc):
    """Run the block on rank 0 first (it fills a cache every process sees), then on the first process of each node
    (it fills a node-local cache, the default ~/.cache/specdistill), then on the others (they read): a cache is
    written by one process per folder, whether the folder is shared or node-local."""
    with acc.main_process_first(), acc.local_main_process_first():
        yield


def _nothing() -> None:
    return None


@dataclass
class WorkShare:
    """How the processes of a launch split a list of work items: this one takes the items whose index is `index`
    modulo `count` (stable whatever is already done, so no process needs to know what another found), and `wait`
    returns once every process of the launch has called it."""
    index: int = 0
    count: int = 1
    wait: Callable[[], None] = _nothing

    def mine(self, items: Sequence[int]) -> list[int]:
        """The item indices of `items` this process owns."""
        return [i for i in items if i % self.count == self.index]


def alone(folder=None) -> WorkShare:
    """One process does all the work (a single-process run)."""
    return WorkShare()


def in_step(acc) -> Callable[[Path], WorkShare]:
    """share(folder) for processes that must do the same work together (a target sharded over them: each of its
    forwards is collective): every process does all of it, after all have looked at the folder."""
    def share(folder: Path) -> WorkShare:
        acc.wait_for_everyone()
        return WorkShare(0, 1, acc.wait_for_everyone)

    return share


def folder_share(acc) -> Callable[[Path], WorkShare]:
    """share(folder) for a launch: how its processes split the work of filling `folder`.

    The processes that see the same folder share its work: all of them on one machine or a shared file system; those
    of each node when the folder is node-local (the default cache is). Which case holds is tested, not assumed: every
    process writes a probe file into its folder and looks for the others'. Collective: every process of the launch
    calls share(folder) (each with its own node's path)."""
    if acc.num_processes == 1:
        return alone

    def share(folder: Path) -> WorkShare:
        from accelerate.utils import broadcast_object_list, gather_object

        token = broadcast_object_list([uuid.uuid4().hex if acc.is_main_process else None])[0]

        def probe(rank: int) -> Path:
            return Path(folder) / f".share-probe-{token}-{rank}"

        probe(acc.process_index).touch()
        acc.wait_for_everyone()
        mine = {r for r in range(acc.num_processes) if probe(r).exists()}
        seen = gather_object([mine])  # by rank: the ranks whose probe it sees
        acc.wait_for_everyone()
        probe(acc.process_index).unlink()
        group = sharing_group(seen, acc.process_index)
        return WorkShare(group.index(acc.process_index), len(group), acc.wait_for_everyone)

    return share


def sharing_group(seen: list[set[int]], rank: int) -> list[int]:
    """The ranks that fill the same folder as `rank`, ascending: its connected component when r and s are linked
    whenever either sees the other's probe (so every rank of a group computes the same group, even if a file system
    shows one probe late)."""
    group, todo = {rank}, [rank]
    while todo:
        r = todo.pop()
        for s in range(len(seen)):
            if s not in group and (s in seen[r] or r in seen[s]):
                group.add(s)
                todo.append(s)
    return sorted(group)
