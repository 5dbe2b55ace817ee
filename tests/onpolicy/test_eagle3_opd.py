"""Draft-OPD with an EAGLE-3 head: rollouts decide as the evaluator does, and the with-grad TTT unroll reproduces the
drafter's own distributions at every drafted position (branches included)."""
import pytest
import torch

from specdistill.models.target import Target
from specdistill.objectives import Models
from specdistill.losses import divergence
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.objectives.eagle3 import Eagle3Objective
from specdistill.drafts.base import min_sum_on_draft_vocab
from specdistill.drafts.eagle3.adapter import eagle3_logits_at
from specdistill.onpolicy.rollout import AFTER_REJECTION, FIRST_REJECTED, collect_rollout
from specdistill.onpolicy.weights import reach_weights
from specdistill.decoding import speculative_generate
from specdistill.drafts.eagle3 import Eagle3Drafter
from tests.conftest import left_padded_prompts, make_tiny_lm, noisy_eagle3_head
from tests.onpolicy.conftest import CountingTarget, perturb

V = 48


@pytest.fixture(scope="module")
def target():
    t = make_tiny_lm(V, layers=4, hidden=32, seed=0).eval()
    t.lm_head.weight.data.mul_(4.0)  # peaked p: every category shows up
    return t


def _head(target, vd=V, seed=0):
    return noisy_eagle3_head(target, vd, seed)


def _prompts():
    return left_padded_prompts([7, 3, 5], seed=1, vocab=V)


@pytest.mark.parametrize("temperature, vd, policy", [(0.0, V, "greedy"), (1.0, 40, "sample"), (1.0, 40, "greedy")])
def test_head_rollout_and_ttt_loss_forward_match_the_drafter(target, temperature, vd, policy):
    head = _head(target, vd).eval()
    ids, mask = _prompts()
    gen = lambda: torch.Generator().manual_seed(0) if temperature else None  # noqa: E731
    # the evaluator's decoder as rollouts run it (stopped rows leave the batch, so later draws are the same)
    ref = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=3, max_new_tokens=12,
                               temperature=temperature, generator=gen(), draft_policy=policy, drop_finished_rows=True)
    pos = collect_rollout(target, head, ids, mask, gamma=3, max_new_tokens=12, temperature=temperature,
                          generator=gen(), draft_policy=policy)
    for b in range(3):
        assert pos.rows[b].tolist() == ids[b][mask[b].bool()].tolist() + ref.tokens(b)
    assert pos.stats.accepted == int(ref.position_accepted.sum())
    assert bool((pos.category == AFTER_REJECTION).any())
    with torch.no_grad():
        q = eagle3_logits_at(head, pos.rows, pos.aux, pos.row, pos.context_len, pos.index, pad_id=0,
                             feature_row=pos.source)                                             # (P, Vd)
    p_full = pos.target.dense()
    # alpha of the TTT distribution against the recorded target == the verifier's alpha from the drafter's q
    q_temperature = 0.0 if policy == "greedy" else temperature  # greedy drafts: q one-hot at its argmax
    assert torch.allclose(min_sum_on_draft_vocab(p_full, q, head.t2d, temperature, q_temperature), pos.alpha, atol=1e-4)
    if q_temperature == 0:  # every drafted token (after a rejection too) is the unroll's argmax on its context
        assert torch.equal(head.draft_to_target(q.argmax(-1)), pos.token)


def test_objective_trains_a_head(target):
    head = _head(target).train()
    obj = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=1.0, replay=False)
    ids, mask = _prompts()
    lm = torch.zeros_like(ids)
    batch = {"input_ids": torch.cat([ids, ids], 1), "attention_mask": torch.cat([mask, mask], 1),
             "loss_mask": torch.cat([lm, lm + 1], 1)}
    batch = {k: torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(v, batch["attention_mask"])])
             for k, v in batch.items()}  # right-padded, as collate makes them
    models = Models(head, Target(target))
    out = obj(batch, models)
    fresh = obj.state.fresh
    assert torch.allclose(out.weight, reach_weights(fresh.alpha, fresh.round_id, fresh.index), atol=1e-4)
    out.loss.mul(out.weight).sum().backward()
    assert head.fc.weight.grad.abs().sum() > 0 and head.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0


def test_head_off_policy_mix_is_the_eagle3_loss_on_the_data_batch(target):
    head = _head(target, 40, seed=3).train()
    models = Models(head, Target(target))
    models.target.set_aux_layer_ids(head.config.aux_layer_ids)  # as build does for draft=eagle3
    obj = DraftOPDObjective(gamma=3, max_new_tokens=6, temperature=1.0, replay=False, kd_weight=0.5)
    batch = _batch()
    prep = obj.prepare(batch, models)
    n = obj.num_tokens(prep)
    out = obj.loss(prep, models)
    P = len(obj.state.fresh)
    off = Eagle3Objective(steps=3)(batch, models)
    assert int(n) == len(out.loss) == P + len(off.loss) and len(off.loss) > 0
    assert torch.allclose(out.loss[P:], off.loss, atol=1e-5)
    assert torch.allclose(out.weight[P:], 0.5 * off.weight)
    assert float(out.metrics["kd_loss_count"]) == len(off.loss)


def _batch():
    ids, mask = _prompts()
    lm = torch.zeros_like(ids)
    batch = {"input_ids": torch.cat([ids, ids], 1), "attention_mask": torch.cat([mask, mask], 1),
             "loss_mask": torch.cat([lm, lm + 1], 1)}
    return {k: torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(v, batch["attention_mask"])])
            for k, v in batch.items()}  # right-padded, as collate makes them


def test_head_replay_rescores_from_cached_target_features(target):
    head = _head(target, 40, seed=2).train()
    models = Models(head, CountingTarget(target))
    try:
        obj = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=1.0, replay=True, replay_ratio=0.5,
                                replay_weight=0.3, divergence="fkl", rollout_every=2)
        obj(_batch(), models)
        fresh = obj.state.fresh
        missed = int((fresh.category == FIRST_REJECTED).sum())
        assert len(obj.state.buffer) == missed > 0
        items = list(obj.state.buffer.items.values())
        # one feature tensor per trajectory, shared by its items (not one copy per position)
        assert len({id(it.aux) for it in items}) <= len(fresh.rows) - sum(s != r for r, s in enumerate(fresh.source))
        # Same rollout, same head: a replayed position scores exactly as the fresh position it came from (its
        # context, slot, step and target features all recovered from the buffer alone).
        missed_at = (fresh.category == FIRST_REJECTED).nonzero().flatten().tolist()
        b1 = _batch()
        prep = obj.prepare(b1, models)
        replayed0 = prep.replay
        same = obj.loss(prep, models)
        obj.end_step()  # one call, one step: the buffer takes its updates
        P0 = len(fresh)
        assert obj.state.refreshes == 1 and len(same.loss) == P0 + len(replayed0) and replayed0
        for k, it in enumerate(replayed0):
            assert torch.allclose(same.loss[P0 + k], same.loss[missed_at[it.uid]], atol=1e-5)
        perturb(head)  # the head changes between the two calls
        b2 = _batch()
        prep = obj.prepare(b2, models)
        calls = models.target.calls
        replayed = prep.replay
        out = obj.loss(prep, models)
        obj.end_step()
        assert models.target.calls == calls  # replay ran no target forward
        P, Q = len(obj.state.fresh), len(replayed)
        assert Q == min(round(0.5 * P), missed) and len(out.loss) == P + Q
        assert torch.allclose(out.weight[P:], torch.full((Q,), 0.3))
        out.loss[P:].sum().backward()
        assert head.fc.weight.grad.abs().sum() > 0
        with torch.no_grad():  # each replayed position scored alone on its own context and its trajectory's features
            for k, it in enumerate(replayed):
                n = len(it.context)
                aux = torch.zeros(1, n, it.aux.shape[-1])
                aux[0, : min(n, len(it.aux))] = it.aux[:n]
                q = eagle3_logits_at(head, [it.context], aux, torch.tensor([0]), torch.tensor([n]),
                                     torch.tensor([it.index]), pad_id=0)
                p, in_vocab = it.target.dense()[:, head.t2d], head.t2d[it.target.dense().argmax(-1)]
                want = divergence("fkl", p, q) * in_vocab
                assert torch.allclose(out.loss[P + k], want[0], atol=1e-4)
                if it.uid in obj.state.buffer.items:  # priority refreshed to 1 - alpha under the current head
                    alpha = min_sum_on_draft_vocab(it.target.dense(), q, head.t2d, 1.0)
                    assert obj.state.buffer.items[it.uid].priority == pytest.approx(1 - float(alpha), abs=1e-5)
    finally:
        models.target.detach_counter()


def _dense_logits_at(head, rows, aux, row, context_len, index):
    """The reference: the full TTT unroll (Eagle3Head.forward) over every row's whole length, read per position."""
    from specdistill.tensors import pad_rows

    ids, mask = pad_rows(rows, 0, side="right", length=aux.shape[1])
    steps = head(aux, ids, mask, steps=int(index.max()) + 1)                         # steps x (R, L, Vd)
    slot = context_len - index - 2
    return torch.stack([steps[int(i)][int(r), int(s)] for r, s, i in zip(row, slot, index)])  # (P, Vd)


@pytest.mark.parametrize("seed,group", [(0, None), (1, None), (0, 1), (1, 3)])
def test_sparse_unroll_equals_the_dense_unroll_values_and_grads(target, seed, group, monkeypatch):
    """The sparse unroll (step 0 over rows, later steps only along chains, in groups of chains that may split a
    row; branch rows reuse their trajectory's step 0 through `shares`; every row reads its trajectory's features
    through `feature_row`, or a copy of its own) gives the dense unroll's logits and parameter gradients at every
    drafted position. group: chains per group forced (None: the cost model's choice)."""
    import specdistill.drafts.eagle3.adapter as adapter

    if group is not None:
        monkeypatch.setattr(adapter, "group_size", lambda counts, keys: group)
    head = _head(target, 40, seed=seed).eval()
    ids, mask = _prompts()
    pos = collect_rollout(target, head, ids, mask, gamma=4, max_new_tokens=14, temperature=1.0,
                          generator=torch.Generator().manual_seed(seed), draft_policy="sample")
    assert any(s != r for r, s in enumerate(pos.source))  # branch rows exist, so sharing is exercised
    head.train()
    w = torch.randn(len(pos), 40, generator=torch.Generator().manual_seed(7))
    grads = []
    per_row = pos.aux[torch.tensor(pos.source)]                                  # (R, L, D) a copy per row
    for fn in (lambda: _dense_logits_at(head, pos.rows, per_row, pos.row, pos.context_len, pos.index),
               lambda: eagle3_logits_at(head, pos.rows, per_row, pos.row, pos.context_len, pos.index, 0, None),
               lambda: eagle3_logits_at(head, pos.rows, pos.aux, pos.row, pos.context_len, pos.index, 0, None,
                                        pos.source),
               lambda: eagle3_logits_at(head, pos.rows, pos.aux, pos.row, pos.context_len, pos.index, 0,
                                        pos.source, pos.source)):
        head.zero_grad()
        q = fn()
        (q * w).sum().backward()
        grads.append((q.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.requires_grad}))
    for q, g in grads[1:]:
        assert torch.allclose(q, grads[0][0], atol=1e-5)
        for n in g:
            assert torch.allclose(g[n], grads[0][1][n], atol=1e-4), n


def test_chain_groups_split_busy_rows_and_keep_quiet_ones_whole():
    """The cost model: rows of very different chain counts (a trajectory's ~100, replayed contexts' 1-2) get groups
    well below the busiest row's count; rows of equal counts keep one group per row."""
    from specdistill.drafts.base import group_size

    uneven = [110] * 16 + [1, 2] * 24
    c = group_size(uneven, keys=240)
    assert c < 110 and sum(-(-n // c) * c for n in uneven) < 0.6 * len(uneven) * 110
    assert group_size([40] * 8, keys=240) == 40
    assert group_size([1], keys=10) == 1


def test_sparse_unroll_refuses_rows_that_do_not_share_their_prefix(target):
    head = _head(target, 40).eval()
    ids, mask = _prompts()
    pos = collect_rollout(target, head, ids, mask, gamma=4, max_new_tokens=14, temperature=1.0,
                          generator=torch.Generator().manual_seed(0), draft_policy="sample")
    wrong = [(s + 1) % 3 if s != r else s for r, s in enumerate(pos.source)]  # branches pointed at another row
    with pytest.raises(ValueError, match="tokens differ"):
        eagle3_logits_at(head, pos.rows, pos.aux, pos.row, pos.context_len, pos.index, 0, wrong, pos.source)
