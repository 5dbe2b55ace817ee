"""The dflash objective: its vectorised loss over many blocks per row equals a naive loop over single blocks; anchors
are loss positions, reproducible from the objective's state; the position decay is exponential."""

import math

import pytest
import torch
import torch.nn.functional as F

from specdistill.models.target import Target
from specdistill.objectives import Models, make_objective
from specdistill.objectives.dflash import position_weights, sample_anchors
from tests.dflash.conftest import V, tiny_dflash, tiny_target


def _batch(R=3, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (R, T), generator=g)
    lengths = torch.tensor([T, T - 6, T - 3])[:R]
    am = (torch.arange(T) < lengths[:, None]).long()
    lm = am.clone()
    lm[:, :5] = 0                                      # a prompt
    lm[torch.arange(R), lengths - 1] = 0               # the last token predicts nothing inside the row
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm}


@pytest.mark.parametrize("target_kind, decay, vd", [("kd", 3.0, None), ("ce", None, None), ("kd", 3.0, 24),
                                                     ("ce", 3.0, 24)])
def test_loss_equals_a_naive_loop_over_blocks(target_kind, decay, vd):
    model = tiny_target()
    kept = None if vd is None else torch.arange(0, 2 * vd, 2)  # every other id: the target's argmax often outside
    draft = tiny_dflash(model, 4, vocab=kept).train()
    target = Target(model, draft.config.aux_layer_ids)
    models = Models(draft, target)
    obj = make_objective({"name": "dflash", "blocks_per_row": 3, "target": target_kind, "decay_length": decay})
    batch = _batch()
    prep = obj.prepare(batch, models)
    out = obj.loss(prep, models)
    total = (out.loss * out.weight).sum()

    # naive: one block at a time, its row's features, soft CE / CE at each block position with a loss
    with torch.no_grad():
        t_out = target(batch["input_ids"], batch["attention_mask"])
    want, count, outside = 0.0, 0, 0
    for r in range(3):
        feats = t_out.aux_hidden[r: r + 1]
        valid = batch["attention_mask"][r: r + 1].bool()
        for a, ok in zip(prep.anchors[r].tolist(), prep.valid[r].tolist()):
            if not ok:
                continue
            assert batch["loss_mask"][r, a] == 1 and a >= 1
            h = draft(feats, valid, batch["input_ids"][r, a].view(1, 1), torch.tensor([[a]]))[0, 0]  # (B, H)
            for k in range(1, 4):
                t = a + k - 1
                if t >= 20 or not batch["loss_mask"][r, t]:
                    continue
                q = F.log_softmax(draft.logits(h[k]), -1)                     # (Vd,)
                p = t_out.logits[r, t]                                        # (V,)
                count += 1
                if kept is not None:
                    if int(p.argmax()) not in kept.tolist():  # the target's token outside the draft vocabulary
                        outside += 1
                        continue
                    p_kept = p[kept]
                    loss = -(p_kept.softmax(-1) * q).sum() if target_kind == "kd" else -q[p_kept.argmax()]
                else:
                    loss = -(p.softmax(-1) * q).sum() if target_kind == "kd" else -q[p.argmax()]
                want = want + loss * (1.0 if decay is None else math.exp(-(k - 1) / decay))
    assert count == int(prep.num_tokens) == out.loss.numel() > 10
    assert (outside > 0) == (vd is not None)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)
    total.backward()
    assert draft.fc.weight.grad is not None and draft.embed_tokens.weight.grad is None  # the shared parts stay frozen


def test_anchors_are_loss_positions_and_reproducible_across_a_resume():
    lm = _batch()["loss_mask"].bool()
    a, ok = sample_anchors(lm, 4, torch.Generator().manual_seed(0))
    assert bool(lm.gather(1, a)[ok].all()) and bool((a[ok] >= 1).all())
    assert all(len(set(a[r][ok[r]].tolist())) == int(ok[r].sum()) for r in range(3))  # distinct per row
    a2, _ = sample_anchors(lm, 40, torch.Generator().manual_seed(0))                    # more than the candidates
    assert int(a2.shape[1]) == 40
    model = tiny_target()
    draft = tiny_dflash(model, 4)
    models = Models(draft, Target(model, draft.config.aux_layer_ids))
    obj = make_objective({"name": "dflash"})
    obj.prepare(_batch(), models)
    state = obj.state_dict()
    nxt = obj.prepare(_batch(), models).anchors
    fresh = make_objective({"name": "dflash"})
    fresh.load_state_dict(state)
    assert torch.equal(fresh.prepare(_batch(), models).anchors, nxt)


def test_position_weights_decay_exponentially():
    w = position_weights(8, 7.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(7.0) / 7.0))
    assert torch.equal(position_weights(4, None), torch.ones(3))


@pytest.mark.parametrize("raw, key", [({"blocks_per_row": 0}, "blocks_per_row"), ({"target": "mse"}, "target"),
                                      ({"decay_length": 0.0}, "decay_length")])
def test_bad_objective_settings_are_refused_by_name(raw, key):
    with pytest.raises(ValueError, match=key):
        make_objective({"name": "dflash", **raw})


def test_held_out_acceptance_reports_the_gamma_a_block_can_draft():
    """A block of 4 drafts 3 tokens: asked for gamma 6, the held-out proxy reports gamma 3 and three rates, never
    positions no block reaches; within the block it counts what gamma 3 counts."""
    from specdistill.eval.simulated import simulated_acceptance

    model = tiny_target()
    draft = tiny_dflash(model, 4)
    target = Target(model, draft.config.aux_layer_ids)
    asked = simulated_acceptance(draft, target, [_batch()], gamma=6)
    ran = simulated_acceptance(draft, target, [_batch()], gamma=3)
    assert asked.gamma == 3 and len(asked.accept_rate_per_pos) == 3
    assert asked == ran
