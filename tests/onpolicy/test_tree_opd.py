"""Draft-OPD under the tree policy: rollouts decode token trees, every context of a tree (accepted path, rejected
siblings and below) is a position on its own context, weighed by the probability that verification reaches it; the
loss against a naive reference, the recipe training a few steps, exact resume, bad settings by name."""
import pytest
import torch

from tests.conftest import left_padded_prompts

from specdistill.decoding import speculative_generate
from specdistill.decoding.tree import TreeShape
from specdistill.losses import divergence
from specdistill.objectives import Models
from specdistill.objectives.draft_opd import DraftOPDObjective, tree_opd_loss
from specdistill.onpolicy.positions import ACCEPTED, AFTER_REJECTION, FIRST_REJECTED
from specdistill.onpolicy.rollout import collect_rollout
from specdistill.onpolicy.weights import tree_reach_weights
from tests.conftest import ONPOLICY_ALONE, compose, tiny_overrides
from tests.onpolicy.conftest import CountingTarget, tiny_lm


def _forest(seed: int, P: int = 30):
    """A random forest of P contexts, parents first: parent (P,) (-1 at roots), edge (P,) (1 at roots)."""
    g = torch.Generator().manual_seed(seed)
    parent = torch.tensor([-1 if i == 0 or torch.rand(1, generator=g) < 0.2 else
                           int(torch.randint(0, i, (1,), generator=g)) for i in range(P)])
    edge = torch.where(parent >= 0, torch.rand(P, generator=g), torch.ones(P))
    return parent, edge


def _naive_reach(parent, edge):
    out = []
    for u in range(len(parent)):
        r, v = 1.0, u
        while v >= 0:
            r *= float(edge[v])
            v = int(parent[v])
        out.append(r)
    return torch.tensor(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_reach_weights_are_products_along_each_path(seed):
    parent, edge = _forest(seed)
    torch.testing.assert_close(tree_reach_weights(parent, edge), _naive_reach(parent, edge))
    chain = torch.arange(-1, 5)  # one child per node: the chain's reach, prod of the earlier edges
    e = torch.tensor([1.0, 0.5, 0.4, 0.3, 0.2, 0.1])
    torch.testing.assert_close(tree_reach_weights(chain, e), torch.cumprod(e, 0))


def test_tree_opd_loss_matches_a_naive_reference():
    parent, edge = _forest(3, 12)
    g = torch.Generator().manual_seed(4)
    p, q = torch.randn(12, 9, generator=g), torch.randn(12, 9, generator=g, requires_grad=True)
    got = tree_opd_loss(p, q, parent, edge, lambda a, b: divergence("fkl", a, b))
    want = 0.0
    for u in range(12):  # sum_u reach(u) KL(p_u || q_u) / P, every term spelled out
        pu, lq = p[u].softmax(-1), q[u].log_softmax(-1)
        want = want + _naive_reach(parent, edge)[u] * (pu * (pu.log() - lq)).sum()
    torch.testing.assert_close(got, want / 12)
    got.backward()
    assert q.grad is not None and bool((q.grad[_naive_reach(parent, edge) == 0] == 0).all())


def _prompts():
    return left_padded_prompts([7, 3, 5], seed=7)


@pytest.mark.parametrize("temperature, eos", [(0.0, None), (1.0, None), (1.0, 7)])
def test_tree_rollout_positions_sit_on_their_own_contexts(temperature, eos):
    """eos: rows stop at it (rounds cut inside their accepted path keep only the contexts before the cut)."""
    target, draft = tiny_lm(0), tiny_lm(1, layers=1)
    ids, mask = _prompts()
    pos = collect_rollout(target, draft, ids, mask, gamma=3, max_new_tokens=12, temperature=temperature,
                          generator=torch.Generator().manual_seed(0), tree=TreeShape(2, 3), eos_token_id=eos)
    P = len(pos)
    assert P > 0 and pos.parent.shape == pos.edge.shape == (P,)
    cats = set(pos.category.tolist())
    assert {FIRST_REJECTED, AFTER_REJECTION} <= cats  # the path's end and the rejected siblings
    assert (ACCEPTED in cats) == (pos.stats.accepted > 0)
    with torch.no_grad():
        for k in range(P):
            ctx = pos.rows[int(pos.row[k])][: int(pos.context_len[k])]
            torch.testing.assert_close(pos.target.values[k], target(ctx[None]).logits[0, -1], atol=1e-4, rtol=1e-4)
            par = int(pos.parent[k])
            if par >= 0:  # the parent's context and this node's token
                pctx = pos.rows[int(pos.row[par])][: int(pos.context_len[par])]
                assert torch.equal(ctx[:-1], pctx) and pos.index[k] == pos.index[par] + 1
                p = (pos.target.values[par] / max(temperature, 1e-9)).softmax(-1) if temperature > 0 else \
                    torch.nn.functional.one_hot(pos.target.values[par].argmax(), 48).float()
                assert float(pos.edge[k]) == pytest.approx(float(p[ctx[-1]]), abs=1e-5)
            else:
                assert pos.index[k] == 0 and pos.edge[k] == 1.0
            if pos.category[k] != ACCEPTED:  # the context's best child is the draft's argmax there
                assert int(draft(ctx[None]).logits[0, -1].argmax()) == int(pos.token[k])
    reach = tree_reach_weights(pos.parent, pos.edge)
    on_path = pos.category != AFTER_REJECTION
    assert bool((pos.row[on_path] < 3).all()) and bool((pos.row[~on_path] >= 3).all())  # branch rows off the path
    for r in pos.round_id.unique():
        assert int(((pos.round_id == r) & (pos.category == FIRST_REJECTED)).sum()) <= 1
    if temperature == 0:  # greedy: verification reaches the path and nothing else
        assert bool((reach[on_path] == 1).all()) and bool((reach[~on_path] == 0).all())
    s = pos.stats
    assert s.new_tokens == sum(len(pos.rows[b]) - int(mask[b].sum()) for b in range(3))
    assert (s.new_tokens == 36) == (eos is None) and s.accepted <= s.drafted and s.emitted / s.target_forwards >= 1
    for k in range(P):  # every context lies within its row (a trajectory ends at its EOS)
        assert int(pos.context_len[k]) <= len(pos.rows[int(pos.row[k])])


def test_the_objective_on_tree_rollouts_equals_the_naive_loss():
    draft = tiny_lm(1, layers=1).train()
    models = Models(draft, CountingTarget(tiny_lm(0)))
    obj = DraftOPDObjective(max_new_tokens=10, temperature=1.0, replay=True, replay_ratio=0.5,
                            tree_topk=2, tree_depth=3, tree_nodes=5)
    ids, mask = _prompts()
    lm = torch.zeros(3, 7, dtype=torch.long)
    lm[:, 6] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": lm}
    prep = obj.prepare(batch, models)
    out = obj.loss(prep, models)
    fresh = obj.state.fresh
    assert int(obj.num_tokens(prep)) == len(out.loss) == len(fresh) > 0 and fresh.parent is not None
    torch.testing.assert_close(out.weight, tree_reach_weights(fresh.parent, fresh.edge))
    with torch.no_grad():
        q = torch.stack([draft(fresh.rows[int(fresh.row[k])][: int(fresh.context_len[k])][None]).logits[0, -1]
                         for k in range(len(fresh))])
    naive = tree_opd_loss(fresh.target.dense(), q, fresh.parent, fresh.edge, lambda a, b: divergence("fkl", a, b))
    torch.testing.assert_close((out.loss * out.weight).sum() / len(fresh), naive, atol=1e-5, rtol=1e-4)
    (out.loss * out.weight).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    obj.end_step()
    assert len(obj.state.buffer) == int((fresh.category == FIRST_REJECTED).sum())


@pytest.mark.parametrize("bad, match", [
    (dict(tree_topk=2, tree_depth=2, tree_nodes=9), "objective.tree_topk/tree_depth/tree_nodes: tree nodes=9 exceeds"),
    (dict(tree_topk=2, weighting="decay"), "objective.weighting=decay"),
    (dict(tree_topk=2, assist=False), "objective.assist=true"),
    (dict(tree_topk=2, draft_policy="sample", temperature=1.0), "objective.draft_policy=greedy"),
    (dict(tree_topk=-1), "objective.tree_topk=-1 must be >= 0"),
])
def test_bad_tree_settings_are_refused_by_name(bad, match):
    from specdistill.objectives import make_objective

    with pytest.raises(ValueError, match=match):
        make_objective({"name": "draft_opd", **bad})


SMALL_LM = ["draft.init=from_target"]


@pytest.mark.parametrize("draft", [SMALL_LM, ["draft=eagle3"]], ids=["lm", "eagle3"])
def test_tree_rollouts_train_and_resume_exactly(draft, tiny_target_dir, tiny_data_file, tmp_path):
    """recipe=draft_opd with objective.tree_topk: a few steps through the one loop, then a run resumed from its
    checkpoint ends with the uninterrupted run's weights and replay buffer (sampled rollouts: the RNG state is
    restored)."""
    from specdistill.build import build
    from specdistill.train.checkpoint import list_checkpoints
    from specdistill.train.loop import fit

    def run(name, extra=()):
        cfg = compose("draft_opd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / name,
                                                  tmp_path / "cache")
                      + ONPOLICY_ALONE + ["trainer.max_steps=4", "trainer.save_every=2", "trainer.keep_checkpoints=5",
                         "trainer.grad_accum=2", "trainer.micro_batch_size=1", "objective.max_new_tokens=6",
                         "objective.tree_topk=2", "objective.tree_depth=3", "objective.rollout_every=3",
                         "objective.replay_ratio=0.5", "objective.temperature=1.0", "trainer.lr=5e-3"]
                      + draft + list(extra))
        c = build(cfg)
        return c, fit(c)

    full, res = run("full")
    assert res.step == 4 and full.objective.tree_shape() == TreeShape(2, 3)
    assert full.objective.state.fresh.parent is not None
    ckpt = list_checkpoints(tmp_path / "full")[0]
    resumed, res = run("resumed", [f"trainer.resume={ckpt}"])
    assert res.step == 4
    pf = full.models.draft.state_dict()
    for k, v in resumed.models.draft.state_dict().items():
        assert torch.allclose(v, pf[k], atol=1e-6), k
    assert sorted(full.objective.state.buffer.items) == sorted(resumed.objective.state.buffer.items)
    torch.testing.assert_close(resumed.objective.state.buffer.priorities(), full.objective.state.buffer.priorities())


@pytest.mark.parametrize("vd", [48, 40])
def test_a_heads_tree_contexts_score_the_trees_children(vd):
    """An EAGLE-3 head's tree rollout: at every context the TTT unroll on its own row (branch rows for the siblings'
    subtrees, the trajectory's features) ranks the tree's children first: the best child is its argmax, an accepted
    child within its top-k; the trajectories are tree decoding's output."""
    from specdistill.drafts.eagle3 import Eagle3Drafter
    from specdistill.drafts.eagle3.adapter import eagle3_logits_at
    from tests.conftest import make_tiny_lm, noisy_eagle3_head

    target = make_tiny_lm(48, layers=4, hidden=32, seed=0).eval()
    target.lm_head.weight.data.mul_(4.0)
    head = noisy_eagle3_head(target, vd, 0).eval()
    ids, mask = _prompts()
    shape = TreeShape(2, 3)
    ref = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=shape, max_new_tokens=12)
    pos = collect_rollout(target, head, ids, mask, gamma=3, max_new_tokens=12, temperature=0.0, tree=shape)
    for b in range(3):
        assert pos.rows[b].tolist() == ids[b][mask[b].bool()].tolist() + ref.tokens(b)
    assert bool((pos.category == AFTER_REJECTION).any())
    with torch.no_grad():
        q = eagle3_logits_at(head, pos.rows, pos.aux, pos.row, pos.context_len, pos.index, pad_id=0,
                             feature_row=pos.source)                                             # (P, Vd)
    best = head.draft_to_target(q.argmax(-1))
    top = head.draft_to_target(q.topk(2, dim=-1).indices)                                       # (P, 2)
    accepted = pos.category == ACCEPTED
    assert torch.equal(best[~accepted], pos.token[~accepted])
    assert bool((top == pos.token[:, None]).any(1).all())


def test_a_draft_not_trained_on_trees_is_refused_by_name():
    from specdistill.models.target import Target
    from tests.dflash.conftest import tiny_dflash, tiny_target

    target = tiny_target()
    obj = DraftOPDObjective(max_new_tokens=6, tree_topk=2, tree_depth=2)
    ids, mask = _prompts()
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": torch.zeros_like(ids)}
    with pytest.raises(ValueError, match="tree_topk=2: a dflash draft decodes token trees but is not trained"):
        obj.prepare(batch, Models(tiny_dflash(target, 4), Target(target)))
