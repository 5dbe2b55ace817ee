"""Drafted positions of a token-tree rollout (Draft-OPD under the tree policy): the contexts where the draft proposed
children, with the probability that verification reaches each. Knows nothing of drafts or objectives; it reads the
TreeRound records of decoding/tree_generate.py (record=True).

A tree round under the pending token (the root) has a context at the root and at every node with a child in the
tree: the draft's distribution there chose those children, and the target scored it in the verify forward (its row
of that node). Each context becomes one drafted position:
  on the accepted path  the trajectory's own prefix (base + depth tokens); ACCEPTED when the path goes on below it,
                        FIRST_REJECTED at the last accepted node (verification rejected all its children)
  off the path          the rejected siblings and the nodes under them: AFTER_REJECTION, on a branch row (the
                        trajectory up to the round's root, then the node's path), kept with branches=True when the
                        round emitted its whole path (as chains' positions after a rejection)
parent (P,) is the position of the context's parent node (-1 at the root) and edge (P,) the probability that
verification moves from the parent to the node, the target's probability of its token there (0/1 at temperature 0:
recursive rejection accepts a top-k child x with probability p(x)); the reach weight of a position is the product of
edge along its path (onpolicy/weights.py: tree_reach_weights). index is the node's depth (an EAGLE-3 head's step).
One branch row serves a chain of off-path contexts (each a prefix of the deepest one's row).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdistill.onpolicy.positions import (ACCEPTED, AFTER_REJECTION, FIRST_REJECTED, DraftedPositions,
                                           RolloutStats, TargetLogits, assemble_positions, trajectories)


def positions_from_tree_rounds(prompt_ids, prompt_mask, rollout, top_k: int, branches: bool) -> DraftedPositions:
    """Turn the TreeRound records of a recorded tree rollout into drafted positions with parent and edge."""
    B = prompt_ids.shape[0]
    device = prompt_ids.device
    trajs = trajectories(prompt_ids, prompt_mask, rollout.sequences.to(device), rollout.num_new_tokens.to(device))
    rows, source = list(trajs), list(range(B))
    plen = prompt_mask.long().sum(1).tolist()
    n_new = int(rollout.num_new_tokens.sum())
    stats = RolloutStats(rows=B, new_tokens=n_new, emitted=n_new, target_forwards=int(rollout.target_forwards.sum()),
                         target_tokens=sum(p - 1 for p in plen))             # the prefill feeds prompt[:-1]
    cols = {k: [] for k in ("row", "ctx", "tok", "cat", "acc", "rid", "idx", "alpha", "parent", "edge")}
    targets: list[TargetLogits] = []
    rid = count = 0
    for rnd in rollout.rounds:
        if rnd.contexts is None:
            raise ValueError("tree positions need a recorded tree rollout: tree_generate(record=True)")
        tree = rnd.tree
        N = tree.num_nodes
        active = rnd.active.tolist()
        stats.target_tokens += sum(active) * (N + 1)
        ancestors = tree.ancestors().cpu()                                   # (B, N+1, N+1)
        depths = tree.depths().cpu()                                         # (B, N+1)
        parents = F.pad(tree.parents, (1, 0), value=-1).cpu()                # (B, N+1), the root's: -1
        node_tokens = F.pad(tree.tokens, (1, 0)).cpu()                       # (B, N+1)
        first_child = tree.children()[..., 0].cpu()                          # (B, N+1)
        edge_all = F.pad(rnd.node_prob.float(), (1, 0), value=1.0).cpu()     # (B, N+1)
        child_mass = torch.zeros(B, N + 1).scatter_add_(1, tree.parents.cpu(), rnd.node_prob.float().cpu())
        path, n_acc = rnd.path.cpu(), rnd.num_accepted.tolist()
        emitted, offset = rnd.num_emitted.tolist(), rnd.offset.tolist()
        contexts = rnd.contexts.cpu()
        for b in range(B):
            if not active[b]:
                continue
            n = n_acc[b]
            on_path = torch.zeros(N + 1, dtype=torch.bool)
            on_path[path[b, : n + 1]] = True
            base = plen[b] + offset[b]                                       # the trajectory up to the root
            ctx = [(j, u) for j, u in enumerate(contexts[b].tolist()) if u >= 0]  # (column, node) in node order
            whole = emitted[b] == n + 1
            keep = [(j, u) for j, u in ctx if (on_path[u] and depths[b, u] < emitted[b]) or
                    (not on_path[u] and branches and whole)]
            stats.drafted += sum(1 for _, u in ctx if on_path[u])
            stats.accepted += n
            stats.alpha += float(sum(child_mass[b, u] for _, u in ctx if on_path[u]))
            local = {u: k for k, (_, u) in enumerate(keep)}
            # Branch rows: deepest off-path contexts first, each parent off the path reuses its child's row.
            row_of: dict[int, int] = {}
            for _, u in reversed(keep):
                if on_path[u]:
                    continue
                if u not in row_of:
                    nodes = ancestors[b, u].nonzero().flatten()
                    nodes = nodes[nodes > 0][depths[b, nodes[nodes > 0]].argsort()]
                    row_of[u] = len(rows)
                    rows.append(torch.cat([trajs[b][:base], node_tokens[b, nodes].to(device)]))
                    source.append(b)
                p = int(parents[b, u])
                if p >= 0 and not on_path[p] and p not in row_of:
                    row_of[p] = row_of[u]
            for _, u in keep:
                d = int(depths[b, u])
                on = bool(on_path[u])
                cols["row"].append(b if on else row_of[u])
                cols["ctx"].append(base + d)
                cols["cat"].append(ACCEPTED if on and d < n else FIRST_REJECTED if on else AFTER_REJECTION)
                cols["acc"].append(on and d < n)
                child = path[b, d + 1] if on and d < n else first_child[b, u]  # the accepted child, else the best
                cols["tok"].append(int(node_tokens[b, child]))
                cols["rid"].append(rid + b)
                cols["idx"].append(d)
                cols["alpha"].append(float(child_mass[b, u]))
                p = int(parents[b, u])
                cols["parent"].append(-1 if p < 0 else count + local[p])
                cols["edge"].append(float(edge_all[b, u]))
            if keep:
                targets.append(TargetLogits.from_logits(rnd.target_logits[b, [j for j, _ in keep]].to(device), top_k))
            count += len(keep)
        rid += B
    long = {k: torch.tensor(cols[k], dtype=torch.long, device=device)
            for k in ("row", "ctx", "tok", "cat", "acc", "rid", "idx", "parent")}
    parts = {k: [long[k]] for k in ("row", "ctx", "tok", "cat", "acc", "rid", "idx")}
    parts["alpha"] = [torch.tensor(cols["alpha"], dtype=torch.float, device=device)]
    out = assemble_positions(rows, parts, targets, stats)
    out.source = source
    out.parent = long["parent"]
    out.edge = torch.tensor(cols["edge"], dtype=torch.float, device=device)
    return out
