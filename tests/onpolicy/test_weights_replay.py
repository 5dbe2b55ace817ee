"""Acceptance weights against hand computations; the replay buffer's bound, priority order and staleness."""
import pytest
import torch

from specdistill.onpolicy.replay import ReplayBuffer, pack_prefixes
from specdistill.onpolicy.rollout import ACCEPTED, AFTER_REJECTION, FIRST_REJECTED, TargetLogits
from specdistill.onpolicy.weights import decay_weights, position_weights, reach_weights

A, F, R = ACCEPTED, FIRST_REJECTED, AFTER_REJECTION


def test_reach_weights_by_hand():
    # round 0: alphas .5 .8 .1 .3 ; round 1: .9 .2 ; round 2: one position
    alpha = torch.tensor([0.5, 0.8, 0.1, 0.3, 0.9, 0.2, 0.7])
    rid = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    idx = torch.tensor([0, 1, 2, 3, 0, 1, 0])
    w = reach_weights(alpha, rid, idx)
    assert torch.allclose(w, torch.tensor([1, 0.5, 0.4, 0.04, 1, 0.9, 1]))
    # order of positions does not matter
    perm = torch.tensor([6, 3, 0, 5, 2, 4, 1])
    assert torch.allclose(reach_weights(alpha[perm], rid[perm], idx[perm]), w[perm])
    # detached even when alpha carries grad
    assert not reach_weights(alpha.clone().requires_grad_(), rid, idx).requires_grad


def test_decay_weights_by_hand():
    cat = torch.tensor([A, A, F, R, R, F, R, A, A])
    rid = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2])
    idx = torch.tensor([0, 1, 2, 3, 4, 0, 1, 0, 1])
    w = decay_weights(cat, idx, rid, decay=0.5)
    assert torch.allclose(w, torch.tensor([1, 1, 1, 0.5, 0.25, 1, 0.5, 1, 1]))
    assert torch.equal(position_weights("none", alpha=None, category=cat, round_id=rid, index=idx, decay=0.5),
                       torch.ones(9))
    with pytest.raises(ValueError, match="weighting"):
        position_weights("nope", alpha=None, category=cat, round_id=rid, index=idx, decay=0.5)


def _add(buf, priorities, now, start=0):
    n = len(priorities)
    ctx = [torch.tensor([start + k]) for k in range(n)]
    buf.add(ctx, TargetLogits(torch.randn(n, 6)), torch.tensor(priorities), now)


def test_replay_bound_and_priority_order():
    buf = ReplayBuffer(capacity=4, max_age=None)
    _add(buf, [0.1, 0.9, 0.5], now=0, start=0)
    _add(buf, [0.7, 0.05, 0.6], now=1, start=10)
    assert len(buf) == 4 and buf.evicted == 2
    # the two lowest priorities went: 0.05 and 0.1
    assert sorted(buf.priorities().tolist()) == pytest.approx([0.5, 0.6, 0.7, 0.9])
    got = buf.sample(3, now=1)
    assert [it.priority for it in got] == pytest.approx([0.9, 0.7, 0.6])
    assert [int(it.context) for it in got] == [1, 10, 12]
    assert got[0].target.values.shape == (1, 6)  # the cached target row travels with the item
    # re-scoring lowers a learned item: it sinks below the others
    buf.update([got[0].uid], torch.tensor([0.01]))
    assert [it.priority for it in buf.sample(4, now=1)] == pytest.approx([0.7, 0.6, 0.5, 0.01])
    # ties: the newest first when sampling, the oldest first when evicting
    tie = ReplayBuffer(capacity=2)
    _add(tie, [0.5, 0.5, 0.5], now=0)
    assert [int(it.context) for it in tie.sample(2, now=0)] == [2, 1]


def test_replay_staleness():
    buf = ReplayBuffer(capacity=10, max_age=2)
    _add(buf, [0.9], now=0, start=0)
    _add(buf, [0.1], now=2, start=1)
    assert len(buf.sample(5, now=2)) == 2
    got = buf.sample(5, now=3)  # the item born at 0 is 3 refreshes old > max_age
    assert [int(it.context) for it in got] == [1] and buf.expired == 1
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity=0)


def test_pack_prefixes_covers_every_context_with_the_fewest_rows_for_chains():
    traj = torch.arange(10, 30)
    branch = torch.cat([traj[:8], torch.tensor([99, 98])])
    other = torch.arange(40, 52)
    contexts = [traj[:5], branch, traj[:12], other[:3], traj[:20], other, branch[:9]]
    rows, row_of = pack_prefixes(contexts)
    assert len(row_of) == len(contexts)
    for c, r in zip(contexts, row_of):  # each context is a prefix of its row
        assert len(rows[r]) >= len(c) and torch.equal(rows[r][: len(c)], c)
    # three chains: the trajectory, the branch off it (not a prefix of the trajectory), the other prompt
    assert len(rows) == 3
    assert row_of[0] == row_of[2] == row_of[4] and row_of[1] == row_of[6] and row_of[3] == row_of[5]
    assert pack_prefixes([]) == ([], [])
