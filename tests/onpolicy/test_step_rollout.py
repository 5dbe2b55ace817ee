"""A step-wide rollout (objective.rollout_scope=step): one rollout over all of an optimizer step's prompts, split back
per micro-batch. Splitting keeps every position with its context, target and round; at T=0 what each micro-batch
trains on is what its own rollout gives; and the config refuses what it cannot do."""
import pytest
import torch

from specdistill.objectives import Models
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.onpolicy.positions import split_trajectories
from specdistill.onpolicy.rollout import collect_rollout
from specdistill.onpolicy.weights import position_weights, tree_reach_weights
from tests.onpolicy.conftest import CountingTarget, tiny_lm


def _micro(seed: int, rows: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 48, (rows, 9), generator=g)
    am = torch.ones_like(ids)
    am[0, 6:] = 0
    lm = torch.zeros_like(ids)
    lm[0, 3:6], lm[1:, 4 + seed % 3:] = 1, 1  # prompts of 3 and 4-6 tokens
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm}


def _models():
    return Models(tiny_lm(1, layers=1).train(), CountingTarget(tiny_lm(0)))


def _rollout(tree: bool, temperature: float = 1.0):
    from specdistill.decoding.tree import TreeShape

    draft, target = tiny_lm(1, layers=1).eval(), tiny_lm(0)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 48, (5, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[3, :2] = 0  # left padding
    return collect_rollout(target, draft, ids * mask, mask, gamma=3, max_new_tokens=12, temperature=temperature,
                           generator=torch.Generator().manual_seed(0), pad_id=0, branches=True,
                           tree=TreeShape(2, 3, 5) if tree else None)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_split_keeps_each_position_with_its_context_target_and_round(tree):
    whole = _rollout(tree)
    traj = torch.as_tensor(whole.source)[whole.row]                             # (P,) each position's trajectory
    assert (traj >= 3).any() and (traj < 3).any() and len(whole.rows) > 5       # both groups, and branch rows
    pieces = split_trajectories(whole, [3, 2])
    assert [len(p) for p in pieces] == [int((traj < 3).sum()), int((traj >= 3).sum())]
    for piece, sel, lo in zip(pieces, [traj < 3, traj >= 3], [0, 3]):
        idx = sel.nonzero().flatten()
        assert [c.tolist() for c in piece.contexts(torch.arange(len(piece)))] == \
               [c.tolist() for c in whole.contexts(idx)]
        assert torch.equal(piece.target.dense(), whole.target.select(idx).dense())
        assert torch.equal(piece.token, whole.token[idx]) and torch.equal(piece.category, whole.category[idx])
        # rows: the group's trajectories first, at 0.., then its branch rows; each row's trajectory renumbered
        assert piece.source[: len(set(piece.source))] == list(range(len(set(piece.source))))
        assert all(torch.equal(piece.rows[r], whole.rows[r + lo]) for r in range(len(set(piece.source))))
        if tree:  # the same reach for each context
            assert torch.allclose(tree_reach_weights(piece.parent, piece.edge),
                                  tree_reach_weights(whole.parent, whole.edge)[idx])
        else:  # rounds renumbered, the same reach weights
            assert int(piece.round_id.min()) == 0
            w = lambda p: position_weights("reach", alpha=p.alpha, category=p.category,  # noqa: E731
                                           round_id=p.round_id, index=p.index, decay=0.9)
            assert torch.allclose(w(piece), w(whole)[idx])
    assert pieces[0].stats is whole.stats and pieces[1].stats.rows == 0  # the decode's stats, once


def test_split_refuses_sizes_that_do_not_tile_the_trajectories():
    whole = _rollout(False)
    with pytest.raises(ValueError, match="do not tile"):
        split_trajectories(whole, [3, 3])


def test_eagle3_features_follow_their_trajectories():
    """A head's rollout carries the target's features per trajectory: each share gets its own trajectories'."""
    from specdistill.onpolicy.positions import DraftedPositions, TargetLogits, RolloutStats

    rows = [torch.arange(4), torch.arange(5), torch.arange(3), torch.tensor([0, 1, 9])]
    z = torch.zeros(4, dtype=torch.long)
    pos = DraftedPositions(rows, torch.tensor([0, 1, 2, 3]), torch.tensor([2, 3, 2, 3]), z,
                           TargetLogits(torch.randn(4, 6)), z, z.bool(), torch.arange(4), z, torch.ones(4),
                           RolloutStats(rows=3), source=[0, 1, 2, 1],
                           aux=torch.arange(3.0)[:, None, None].expand(3, 5, 2))
    a, b = split_trajectories(pos, [1, 2])
    assert torch.equal(a.aux, pos.aux[:1]) and torch.equal(b.aux, pos.aux[1:])
    assert b.source == [0, 1, 0] and b.row.tolist() == [0, 1, 2] and [r.tolist() for r in b.rows] == \
           [rows[1].tolist(), rows[2].tolist(), rows[3].tolist()]


def _step(obj: DraftOPDObjective, micro: list[dict], models: Models):
    obj.prepare_step(micro, models)
    outs = []
    for b in micro:
        prep = obj.prepare(b, models)
        outs.append((prep, obj.loss(prep, models)))
    obj.end_step()
    return outs


def test_greedy_step_rollout_trains_each_micro_batch_on_what_its_own_rollout_gives():
    """At T=0 decoding is deterministic, so decoding a step's prompts together changes no position: each micro-batch
    gets the positions, targets and losses its own rollout gives, and the step is one rollout, not two."""
    kw = dict(gamma=3, max_new_tokens=10, temperature=0.0, replay=True, replay_ratio=0.5)
    micro = [_micro(0), _micro(1, rows=3)]
    models = _models()
    alone, together = DraftOPDObjective(**kw), DraftOPDObjective(**kw, rollout_scope="step")
    for _ in range(2):  # the second step replays the first's rejections
        for (pa, oa), (pt, ot) in zip(_step(alone, micro, models), _step(together, micro, models)):
            assert len(pa.fresh) == len(pt.fresh) > 0 and len(pa.replay) == len(pt.replay)
            assert [c.tolist() for c in pa.fresh.contexts(torch.arange(len(pa.fresh)))] == \
                   [c.tolist() for c in pt.fresh.contexts(torch.arange(len(pt.fresh)))]
            torch.testing.assert_close(pt.fresh.target.dense(), pa.fresh.target.dense(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ot.loss, oa.loss, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ot.weight, oa.weight, rtol=1e-4, atol=1e-5)
    assert (alone.state.refreshes, together.state.refreshes) == (4, 2)
    assert (alone.state.calls, together.state.calls) == (4, 4)
    assert len(alone.state.buffer) == len(together.state.buffer) > 0


def test_a_steps_rollout_is_logged_once_and_every_share_enters_the_buffer():
    models = _models()
    obj = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=1.0, replay=True, rollout_scope="step")
    outs = _step(obj, [_micro(0), _micro(1), _micro(2)], models)
    assert ["rollout_tau_sum" in o.metrics for _, o in outs] == [True, False, False]
    assert float(outs[0][1].metrics["rollout_target_tokens_count"]) == 1
    assert all(p.add_to_buffer for p, _ in outs) and obj.state.step_shares == []
    rejected = sum(int((p.fresh.category == 1).sum()) for p, _ in outs)
    assert len(obj.state.buffer) == min(rejected, obj.replay_capacity)
    # one micro-batch: the step is that micro-batch's own rollout, as with rollout_scope=micro_batch
    obj.prepare_step([_micro(3)], models)
    assert obj.state.step_shares == []


def test_step_scope_refuses_rollout_reuse():
    with pytest.raises(ValueError, match="rollout_every=1"):
        DraftOPDObjective(rollout_scope="step", rollout_every=2)
    with pytest.raises(ValueError, match="rollout_scope"):
        DraftOPDObjective(rollout_scope="steps")
