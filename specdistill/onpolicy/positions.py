"""Drafted positions (Draft-OPD, arXiv 2605.29343): the containers a rollout fills, and their assembly from the
RoundRecords of a recorded speculative rollout, chains or token trees. Knows nothing of drafts or objectives; see
onpolicy/rollout.py for the categories and the row layout.

A round has a context at the root (the pending token) and at every node with a child: the draft's distribution
there chose those children, and the target scored it in the verify forward (its row of that node). A chain's are
its root and drafts d_1..d_{K-1}, each proposing the next draft. Each context becomes one drafted position:
  on the accepted path  the trajectory's own prefix (base + depth tokens); ACCEPTED when the path goes on below it,
                        FIRST_REJECTED at the last accepted node (verification rejected its children)
  off the path          after a rejection: AFTER_REJECTION, on a branch row (the trajectory up to the round's root,
                        then the node's path), kept with branches=True when the round emitted its whole path
A tree's positions also get parent (P,), the position of the context's parent node (-1 at the root), and edge (P,),
the probability that verification moves from the parent to the node, the target's probability of its token there
(0/1 at temperature 0: recursive rejection accepts a top-k child x with probability p(x)); the reach weight of a
position is the product of edge along its path (onpolicy/weights.py: tree_reach_weights). index is the node's depth
(an EAGLE-3 head's step). One branch row serves a chain of off-path contexts (each a prefix of the deepest one's row).
Chains are built all positions at once (the fast path), trees row by row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F


ACCEPTED, FIRST_REJECTED, AFTER_REJECTION = 0, 1, 2
CATEGORIES = ("accepted", "first_rejected", "after_rejection")


# ----------------------------------------------------------------------------------------------- containers
@dataclass
class TargetLogits:
    """The target's distribution at P positions: full raw logits (P, V), or its top-k (values, ids (P, k))."""

    values: torch.Tensor                   # (P, V) or (P, k)
    indices: Optional[torch.Tensor] = None  # (P, k) long, None = full
    vocab: int = 0

    @classmethod
    def from_logits(cls, logits: torch.Tensor, top_k: int = 0) -> "TargetLogits":
        V = logits.shape[-1]
        if top_k and top_k < V:
            values, indices = logits.float().topk(top_k, dim=-1)
            return cls(values, indices, V)
        return cls(logits.float(), None, V)

    def __len__(self) -> int:
        return self.values.shape[0]

    def select(self, idx: torch.Tensor) -> "TargetLogits":
        return TargetLogits(self.values[idx], None if self.indices is None else self.indices[idx], self.vocab)

    def to(self, device) -> "TargetLogits":
        return TargetLogits(self.values.to(device), None if self.indices is None else self.indices.to(device),
                            self.vocab)

    def dense(self) -> torch.Tensor:
        """(P, V) logits. Top-k: the tail sits 20 nats under the k-th logit (~e^-20 each, finite so that reverse KL
        and JSD stay finite): p is the top-k renormalised, to within V * e^-20."""
        if self.indices is None:
            return self.values
        floor = self.values.min(-1, keepdim=True).values - 20.0            # (P, 1)
        out = floor.expand(-1, self.vocab).clone()
        return out.scatter_(1, self.indices, self.values)

    @staticmethod
    def cat(parts: list["TargetLogits | LogitRows"]) -> "TargetLogits":
        """The parts in order; full logits (LogitRows among them) are copied once, straight into the one output."""
        if any((p.indices is None) != (parts[0].indices is None) for p in parts):
            raise ValueError("cannot mix full and top-k target logits")
        if parts[0].indices is not None:
            return TargetLogits(torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts]),
                                parts[0].vocab)
        first = parts[0].src if isinstance(parts[0], LogitRows) else parts[0].values
        out = torch.empty(sum(map(len, parts)), first.shape[-1], device=first.device)   # (P, V) float32
        start = 0
        for p in parts:
            rows = out[start: start + len(p)]
            if not isinstance(p, LogitRows):
                rows.copy_(p.values)
            elif p.src.dtype == out.dtype:
                torch.index_select(p.src, 0, p.idx, out=rows)
            else:
                rows.copy_(p.src.index_select(0, p.idx))
            start += len(p)
        return TargetLogits(out, None, first.shape[-1])


@dataclass
class LogitRows:
    """Rows idx (n,) of full raw logits src (N, V), not copied yet: TargetLogits.cat gathers them into its output (a
    rollout's positions then copy the target's logits once, not once per round and again to join the rounds)."""

    src: torch.Tensor
    idx: torch.Tensor
    indices = None  # full logits, as TargetLogits with indices None

    def __len__(self) -> int:
        return self.idx.shape[0]


@dataclass
class RolloutStats:
    """Sums over one rollout batch (ratios are taken from sums)."""

    rows: int = 0
    new_tokens: int = 0          # tokens generated
    target_forwards: int = 0     # row-rounds (assist) or simulated blocks (no assist)
    emitted: int = 0             # tokens those rounds emit (accepted drafts + the correction or bonus): tau = emitted
    #                              / target_forwards; = new_tokens with assist, what speculation would emit without
    drafted: int = 0             # drafted positions verified
    accepted: int = 0            # of them accepted by the verifier
    alpha: float = 0.0           # sum of sum_x min(p, q) over drafted positions (rollout temperature)
    target_tokens: int = 0       # tokens the target ran a forward over (prefill + verification, real rows only)
    # the rounds by where in the output each started: output_positions.BucketCounts per bucket (assisted rollouts)
    output_buckets: list = field(default_factory=list)


@dataclass
class DraftedPositions:
    """P drafted positions with their contexts in R token rows (1-D, unpadded)."""

    rows: list[torch.Tensor]     # R x (L_r,) long
    row: torch.Tensor            # (P,) which row holds the context
    context_len: torch.Tensor    # (P,) the context is rows[row][:context_len]; the draft predicts the next token
    token: torch.Tensor          # (P,) the drafted token
    target: TargetLogits         # (P, V) the target's raw logits at the position
    category: torch.Tensor       # (P,) ACCEPTED | FIRST_REJECTED | AFTER_REJECTION
    accepted: torch.Tensor       # (P,) bool, the verifier's decision (== category ACCEPTED)
    round_id: torch.Tensor       # (P,) one id per (round, row); positions of a round are contiguous, by index
    index: torch.Tensor          # (P,) 0-based draft position within the round
    alpha: torch.Tensor          # (P,) sum_x min(p, q) at the rollout's temperature (0/1 at temperature 0)
    stats: RolloutStats = field(default_factory=RolloutStats)
    source: Optional[list[int]] = None   # R: the trajectory each row comes from (a branch: its round's row)
    # drafts that read the target's features (EAGLE-3, DFlash): (B, L, D) per trajectory; row r reads aux[source[r]]
    aux: Optional[torch.Tensor] = None
    # token-tree rollouts (module docstring): each position's parent position (-1 at a round's root) and the
    # probability that verification moves from it to this context's node; None for chains
    parent: Optional[torch.Tensor] = None  # (P,) long
    edge: Optional[torch.Tensor] = None    # (P,) float

    def __len__(self) -> int:
        return self.row.shape[0]

    def contexts(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The context token rows of positions idx (each (context_len,))."""
        return [self.rows[int(r)][: int(n)] for r, n in zip(self.row[idx].tolist(), self.context_len[idx].tolist())]


def split_trajectories(positions: DraftedPositions, sizes: list[int]) -> list[DraftedPositions]:
    """One rollout of B = sum(sizes) trajectories -> len(sizes) rollouts of sizes[g] consecutive trajectories each, as
    if each group had been rolled out alone: group g keeps its trajectories' rows (the trajectories first, then their
    branch rows, in order), their positions (in order), their features, and ids renumbered from 0 (rows, sources,
    rounds; a tree's parents). The rollout's stats go to group 0, whose decode they describe; the others get empty
    stats. Needs positions.source (every assembled rollout has it: trajectories in rows 0..B-1)."""
    B = sum(sizes)
    source = positions.source
    if source is None or len(source) < B or list(source[:B]) != list(range(B)) or min(sizes, default=1) < 1:
        raise ValueError(f"split_trajectories: sizes {sizes} do not tile the rollout's trajectories (rows 0..B-1)")
    device = positions.row.device
    src = torch.as_tensor(source, dtype=torch.long, device=device)            # (R,) each row's trajectory
    bounds = torch.tensor([0] + sizes, device=device).cumsum(0)               # (G + 1,)
    group_of_row = torch.bucketize(src, bounds[1:], right=True)               # (R,)
    pos_group = group_of_row[positions.row]                                   # (P,)
    out = []
    for g, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        rows = (group_of_row == g).nonzero().flatten()                        # trajectories, then branches
        new_row = torch.full((len(source),), -1, dtype=torch.long, device=device)
        new_row[rows] = torch.arange(len(rows), device=device)
        keep = (pos_group == g).nonzero().flatten()                           # (Pg,)
        _, rid = torch.unique_consecutive(positions.round_id[keep], return_inverse=True)
        piece = DraftedPositions(
            [positions.rows[r] for r in rows.tolist()], new_row[positions.row[keep]], positions.context_len[keep],
            positions.token[keep], positions.target.select(keep), positions.category[keep],
            positions.accepted[keep], rid, positions.index[keep], positions.alpha[keep],
            positions.stats if g == 0 else RolloutStats(),
            source=[int(source[r]) - lo for r in rows.tolist()],
            aux=None if positions.aux is None else positions.aux[lo:hi])
        if positions.parent is not None:
            new_pos = torch.full((len(positions),), -1, dtype=torch.long, device=device)
            new_pos[keep] = torch.arange(len(keep), device=device)
            parent = positions.parent[keep]
            piece.parent = torch.where(parent >= 0, new_pos[parent.clamp_min(0)], parent)
            piece.edge = positions.edge[keep]
        out.append(piece)
    return out


def trajectories(prompt_ids, prompt_mask, sequences, num_new) -> list[torch.Tensor]:
    return [torch.cat([prompt_ids[b][prompt_mask[b].bool()], sequences[b, : int(num_new[b])]])
            for b in range(prompt_ids.shape[0])]


def trajectory_features(hidden: torch.Tensor, prompt_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Rollout.hidden (B, T-1+N, D), column c = token c of [left-padded prompt (B, T), generated tokens], -> (B, L, D)
    per trajectory, right-aligned to the unpadded rows: trajectory b's token t at slot t, L = length. A branch row
    reads its source trajectory's features (it shares that trajectory's tokens up to its round's accepted drafts, the
    only slots read there), so branches get no copy of their own. Slots without a feature (a trajectory's last
    token, past its end) are zero."""
    B, C, D = hidden.shape
    pad = prompt_mask.shape[1] - prompt_mask.long().sum(1)                  # (B,) left padding of each prompt
    col = pad.to(hidden.device)[:, None] + torch.arange(length, device=hidden.device)  # (B, L) column of token t
    return hidden.gather(1, col.clamp(max=C - 1)[..., None].expand(B, length, D)) * (col < C)[..., None]  # (B, L, D)


# ----------------------------------------------------------------------------------------------- assisted
_KEYS = ("row", "ctx", "tok", "cat", "acc", "rid", "idx", "alpha")


@dataclass
class _Positions:
    """What positions_from_rounds() fills round by round."""

    trajs: list[torch.Tensor]      # B final trajectories (prompt + generated tokens)
    rows: list[torch.Tensor]       # the trajectories, then one branch row per off-path chain of contexts
    source: list[int]              # each row's trajectory
    plen: torch.Tensor             # (B,) prompt lengths
    stats: RolloutStats
    parts: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {k: [] for k in _KEYS + ("parent", "edge")})
    targets: list[TargetLogits | LogitRows] = field(default_factory=list)
    rid: int = 0                   # the next round's first round id (one per (round, row))
    count: int = 0                 # positions so far

    def add(self, cols: dict[str, torch.Tensor], target: TargetLogits | LogitRows) -> None:
        for k, v in cols.items():
            self.parts[k].append(v)
        self.targets.append(target)
        self.count += len(target)


def positions_from_rounds(prompt_ids, prompt_mask, rollout, top_k: int, branches: bool) -> DraftedPositions:
    """Turn the RoundRecords of a recorded speculative rollout (chains or trees) into drafted positions."""
    B = prompt_ids.shape[0]
    device = prompt_ids.device
    trajs = trajectories(prompt_ids, prompt_mask, rollout.sequences.to(device), rollout.num_new_tokens.to(device))
    plen = prompt_mask.long().sum(1)                                         # (B,)
    n_new = int(rollout.num_new_tokens.sum())
    stats = RolloutStats(rows=B, new_tokens=n_new, emitted=n_new, target_forwards=int(rollout.target_forwards.sum()),
                         target_tokens=int((plen - 1).sum()))                # the prefill feeds prompt[:-1]
    acc = _Positions(trajs, list(trajs), list(range(B)), plen, stats)
    trees = False
    for rnd in rollout.rounds:
        stats.target_tokens += int(rnd.active.sum()) * (rnd.proposal.num_nodes + 1)
        if rnd.proposal.is_chain:
            _chain_round(acc, rnd, top_k, branches)
        else:
            trees = True
            _tree_round(acc, rnd, top_k, branches)
        acc.rid += B
    out = assemble_positions(acc.rows, {k: acc.parts[k] for k in _KEYS}, acc.targets, stats)
    out.source = acc.source
    if trees:
        out.parent = torch.cat(acc.parts["parent"]) if acc.parts["parent"] else torch.zeros(0, dtype=torch.long,
                                                                                                  device=device)
        out.edge = torch.cat(acc.parts["edge"]) if acc.parts["edge"] else torch.zeros(0, device=device)
    return out


def _chain_round(acc: _Positions, rnd, top_k: int, branches: bool) -> None:
    """A chain's positions, all at once: draft position i's context is the root and d_1..d_i."""
    K = rnd.gamma
    if K == 0:
        return
    device = acc.plen.device
    rows = rnd.row_ids().to(device)                                      # (R,) the rollout's rows the round ran
    R = rows.shape[0]
    active = rnd.active.to(device)
    n, count = rnd.num_accepted.to(device), rnd.num_emitted.to(device)   # (R,)
    i = torch.arange(K, device=device).expand(R, K)                      # (R, K)
    category = torch.where(i < n[:, None], ACCEPTED, torch.where(i == n[:, None], FIRST_REJECTED, AFTER_REJECTION))
    # On the trajectory: contexts within what the round emitted (drafts past an EOS inside the accepted run are
    # dropped). After a rejection: kept when the whole accepted run + correction was emitted.
    on_traj = i < count[:, None]
    off_traj = (i > n[:, None]) & (count == n + 1)[:, None]
    keep = active[:, None] & (on_traj | (off_traj & branches))          # (R, K)
    acc.stats.drafted += int((active[:, None] & (i <= n[:, None])).sum())   # what the verifier decided on
    acc.stats.accepted += int((rnd.accepted.to(device) & active[:, None]).sum())
    acc.stats.alpha += float((rnd.alpha.to(device) * (active[:, None] & (i <= n[:, None]))).sum())
    base = acc.plen[rows] + rnd.offset.to(device)                        # (R,) context length at draft 0
    row = rows[:, None].expand(R, K).clone()                             # (R, K)
    drafts = rnd.draft_tokens.to(device)
    for r in (keep & off_traj).any(1).nonzero().flatten().tolist():     # one branch row per such round
        nb, start, b = int(n[r]), int(base[r]), int(rows[r])
        row[r, nb + 1:] = len(acc.rows)
        acc.rows.append(torch.cat([acc.trajs[b][: start + nb], drafts[r, nb: K - 1]]))
        acc.source.append(b)
    sel = keep.nonzero(as_tuple=True)                                    # row-major: rounds contiguous, by index
    acc.add({"row": row[sel], "ctx": (base[:, None] + i)[sel], "tok": drafts[sel], "cat": category[sel],
             "acc": rnd.accepted.to(device)[sel], "rid": (acc.rid + rows[:, None].expand(R, K))[sel],
             "idx": i[sel], "alpha": rnd.alpha.to(device).float()[sel]},
            _round_targets(rnd.target_logits.to(device), sel, top_k))


def _round_targets(logits: torch.Tensor, sel: tuple[torch.Tensor, torch.Tensor], top_k: int):
    """A chain round's target logits (R, K+1, V) at the positions sel (rows, draft indices): LogitRows of the full
    logits (copied once, when the rollout's positions are joined), or their top-k now."""
    V = logits.shape[-1]
    if top_k and top_k < V:
        return TargetLogits.from_logits(logits[sel], top_k)
    return LogitRows(logits.reshape(-1, V), sel[0] * logits.shape[1] + sel[1])


def _tree_round(acc: _Positions, rnd, top_k: int, branches: bool) -> None:
    """A tree's positions, row by row: its contexts (the root and every node with a child), with parent and edge."""
    if rnd.contexts is None:
        raise ValueError("tree positions need a recorded tree rollout: speculative_generate(record=True)")
    device = acc.plen.device
    tree = rnd.proposal
    R, N = tree.tokens.shape                                             # the round's rows (rnd.rows)
    ancestors = tree.ancestors().cpu()                                   # (R, N+1, N+1)
    depths = tree.depths().cpu()                                         # (R, N+1)
    parents = F.pad(tree.parents, (1, 0), value=-1).cpu()                # (R, N+1), the root's: -1
    node_tokens = F.pad(tree.tokens, (1, 0)).cpu()                       # (R, N+1)
    first_child = tree.children()[..., 0].cpu()                          # (R, N+1)
    edge_all = F.pad(rnd.node_prob.float(), (1, 0), value=1.0).cpu()     # (R, N+1)
    child_mass = torch.zeros(R, N + 1).scatter_add_(1, tree.parents.cpu(), rnd.node_prob.float().cpu())
    path, n_acc, active = rnd.path.cpu(), rnd.num_accepted.tolist(), rnd.active.tolist()
    emitted, offset, plen = rnd.num_emitted.tolist(), rnd.offset.tolist(), acc.plen.tolist()
    contexts, rows = rnd.contexts.cpu(), rnd.row_ids().tolist()
    for b in range(R):  # the round's row b is the rollout's row rows[b]
        if not active[b]:
            continue
        n = n_acc[b]
        on_path = torch.zeros(N + 1, dtype=torch.bool)
        on_path[path[b, : n + 1]] = True
        base = plen[rows[b]] + offset[b]                                       # the trajectory up to the root
        ctx = [(j, u) for j, u in enumerate(contexts[b].tolist()) if u >= 0]  # (column, node) in node order
        whole = emitted[b] == n + 1
        keep = [(j, u) for j, u in ctx if (on_path[u] and depths[b, u] < emitted[b]) or
                (not on_path[u] and branches and whole)]
        acc.stats.drafted += sum(1 for _, u in ctx if on_path[u])
        acc.stats.accepted += n
        acc.stats.alpha += float(sum(child_mass[b, u] for _, u in ctx if on_path[u]))
        if not keep:
            continue
        local = {u: k for k, (_, u) in enumerate(keep)}
        # Branch rows: deepest off-path contexts first, each parent off the path reuses its child's row.
        row_of: dict[int, int] = {}
        for _, u in reversed(keep):
            if on_path[u]:
                continue
            if u not in row_of:
                nodes = ancestors[b, u].nonzero().flatten()
                nodes = nodes[nodes > 0][depths[b, nodes[nodes > 0]].argsort()]
                row_of[u] = len(acc.rows)
                acc.rows.append(torch.cat([acc.trajs[rows[b]][:base], node_tokens[b, nodes].to(device)]))
                acc.source.append(rows[b])
            p = int(parents[b, u])
            if p >= 0 and not on_path[p] and p not in row_of:
                row_of[p] = row_of[u]
        cols: dict[str, list] = {k: [] for k in _KEYS + ("parent", "edge")}
        for _, u in keep:
            d, on, p = int(depths[b, u]), bool(on_path[u]), int(parents[b, u])
            child = path[b, d + 1] if on and d < n else first_child[b, u]  # the accepted child, else the best
            cols["row"].append(rows[b] if on else row_of[u])
            cols["ctx"].append(base + d)
            cols["cat"].append(ACCEPTED if on and d < n else FIRST_REJECTED if on else AFTER_REJECTION)
            cols["acc"].append(on and d < n)
            cols["tok"].append(int(node_tokens[b, child]))
            cols["rid"].append(acc.rid + rows[b])
            cols["idx"].append(d)
            cols["alpha"].append(float(child_mass[b, u]))
            cols["parent"].append(-1 if p < 0 else acc.count + local[p])
            cols["edge"].append(float(edge_all[b, u]))
        floats = ("alpha", "edge")
        acc.add({k: torch.tensor(v, dtype=torch.float if k in floats else torch.long, device=device)
                 for k, v in cols.items()},
                TargetLogits.from_logits(rnd.target_logits[b, [j for j, _ in keep]].to(device), top_k))


def assemble_positions(rows, parts, targets, stats) -> DraftedPositions:
    device = rows[0].device
    if not targets:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return DraftedPositions(rows, empty, empty, empty, TargetLogits(torch.zeros(0, 1, device=device)), empty,
                                empty.bool(), empty, empty, empty.float(), stats)
    cat = {k: torch.cat(v) for k, v in parts.items()}
    # round ids renumbered 0.. in order of appearance
    _, rid = torch.unique_consecutive(cat["rid"], return_inverse=True)
    return DraftedPositions(rows, cat["row"], cat["ctx"], cat["tok"], TargetLogits.cat(targets), cat["cat"],
                            cat["acc"].bool(), rid, cat["idx"], cat["alpha"], stats)


