"""Draft-OPD with an EAGLE-3 head: rollouts decide as the evaluator does, and the with-grad TTT unroll reproduces the
drafter's own distributions at every drafted position (branches included)."""
import pytest
import torch

from specdistill.models.eagle3 import build_eagle3
from specdistill.models.target import Target
from specdistill.objectives import Models
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.onpolicy.eagle3 import eagle3_alpha, eagle3_logits_at
from specdistill.onpolicy.rollout import AFTER_REJECTION, collect_rollout
from specdistill.onpolicy.weights import reach_weights
from specdistill.spec import Eagle3Drafter, speculative_generate
from tests.conftest import make_tiny_lm

V = 48


@pytest.fixture(scope="module")
def target():
    t = make_tiny_lm(V, layers=4, hidden=32, seed=0).eval()
    t.lm_head.weight.data.mul_(4.0)  # peaked p: every category shows up
    return t


def _head(target, vd=V, seed=0):
    torch.manual_seed(seed)
    head = build_eagle3(target, torch.randperm(V)[:vd].sort().values, None)
    for p in head.parameters():
        if p.requires_grad:
            p.data.add_(0.05 * torch.randn_like(p))
    return head


def _prompts():
    lengths = torch.tensor([7, 3, 5])
    ids = torch.randint(3, V, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(7) >= 7 - lengths[:, None]).long()
    return ids * mask, mask


@pytest.mark.parametrize("temperature, vd", [(0.0, V), (1.0, 40)])
def test_head_rollout_and_ttt_loss_forward_match_the_drafter(target, temperature, vd):
    head = _head(target, vd).eval()
    ids, mask = _prompts()
    gen = lambda: torch.Generator().manual_seed(0) if temperature else None  # noqa: E731
    ref = speculative_generate(target, Eagle3Drafter(head), ids, mask, gamma=3, max_new_tokens=12,
                               temperature=temperature, generator=gen())
    pos = collect_rollout(target, head, ids, mask, gamma=3, max_new_tokens=12, temperature=temperature,
                          generator=gen())
    for b in range(3):
        assert pos.rows[b].tolist() == ids[b][mask[b].bool()].tolist() + ref.tokens(b)
    assert pos.stats.accepted == int(ref.position_accepted.sum())
    assert bool((pos.category == AFTER_REJECTION).any())
    with torch.no_grad():
        q = eagle3_logits_at(head, pos.rows, pos.aux, pos.row, pos.context_len, pos.index, pad_id=0)  # (P, Vd)
    p_full = pos.target.dense()
    # alpha of the TTT distribution against the recorded target == the verifier's alpha from the drafter's q
    assert torch.allclose(eagle3_alpha(p_full, q, head.t2d, temperature), pos.alpha, atol=1e-4)
    if temperature == 0:  # every drafted token (after a rejection too) is the unroll's argmax on its context
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
    fresh = obj._fresh
    assert torch.allclose(out.weight, reach_weights(fresh.alpha, fresh.round_id, fresh.index), atol=1e-4)
    out.loss.mul(out.weight).sum().backward()
    assert head.fc.weight.grad.abs().sum() > 0 and head.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="replay"):
        DraftOPDObjective(gamma=3, max_new_tokens=6)(batch, models)
