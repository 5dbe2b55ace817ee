"""What a rollout's verify forwards leave behind is what a fresh target forward gives: the target's logits at every
drafted position (branches after a rejection included) and the EAGLE-3 aux features of every trajectory token, on
left-padded prompts with ragged acceptance (fp32, allclose). So the loss needs no second target pass."""
import copy

import pytest
import torch

from specdistill.decoding import LMDrafter, speculative_generate
from specdistill.drafts.eagle3 import Eagle3Drafter, build_eagle3
from specdistill.objectives import Models
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.onpolicy.rollout import AFTER_REJECTION, FIRST_REJECTED, collect_rollout
from tests.conftest import nudged
from tests.onpolicy.conftest import CountingTarget, perturb, tiny_lm

V, LAYERS = 48, [1, 2, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0, layers=4)


def _head(target, seed=0):
    torch.manual_seed(seed)
    return nudged(build_eagle3(target, torch.arange(V), LAYERS)).eval()


def _fresh(target, rows: list[torch.Tensor]):
    """One plain forward per row (no cache, no padding): logits (L, V) and the aux features (L, 3H) per row."""
    out = [target(input_ids=r[None], output_hidden_states=True) for r in rows]
    return [o.logits[0] for o in out], [torch.cat([o.hidden_states[k][0] for k in LAYERS], -1) for o in out]


@torch.no_grad()
@pytest.mark.parametrize("policy", ["greedy", "sample"])
def test_captured_features_equal_a_fresh_target_forward(target, ragged_prompts, policy):
    ids, mask = ragged_prompts                                              # (3, 7): lengths 7, 3, 5
    draft = copy.deepcopy(target)
    perturb(draft, 0.1)                                                     # q near p: drafts accepted sometimes
    r = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=3, max_new_tokens=16,
                             temperature=1.0, generator=torch.Generator().manual_seed(0), draft_policy=policy,
                             capture_layers=LAYERS)
    assert 0 < int(r.position_accepted.sum()) < int(r.position_proposed.sum())  # rejections, ragged rows
    T = ids.shape[1]
    for b in range(3):
        pad, n = T - int(mask[b].sum()), int(r.num_new_tokens[b])
        traj = torch.cat([ids[b, pad:], r.sequences[b, :n]])
        _, (feats,) = _fresh(target, [traj[:-1]])                           # every token but the last was fed
        got = r.hidden[b, pad: T - 1 + n]                                   # (len(traj) - 1, 3H)
        assert torch.allclose(got, feats, atol=1e-5), f"row {b}"
        assert not r.hidden[b, T - 1 + n:].any()                            # nothing past the row's fed tokens


@torch.no_grad()
@pytest.mark.parametrize("kind", ["lm", "eagle3"])
def test_rollout_logits_and_row_features_equal_a_fresh_target_forward(target, ragged_prompts, kind):
    ids, mask = ragged_prompts
    draft = tiny_lm(1, layers=1) if kind == "lm" else _head(target)
    pos = collect_rollout(target, draft, ids, mask, gamma=3, max_new_tokens=16, temperature=1.0,
                          generator=torch.Generator().manual_seed(0))
    assert bool((pos.category == AFTER_REJECTION).any()) and bool((pos.category == FIRST_REJECTED).any())
    # logits: the verify forward's row at each drafted position == a fresh forward over the position's context
    logits, feats = _fresh(target, pos.rows)
    ctx = pos.context_len
    fresh = torch.stack([logits[int(r)][int(n) - 1] for r, n in zip(pos.row, ctx)])  # (P, V)
    assert torch.allclose(pos.target.dense(), fresh, atol=1e-4)
    if kind == "lm":
        assert pos.aux is None
        return
    # features: one tensor per trajectory, whatever the number of branch rows; every trajectory token's (all but its
    # last) == the fresh forward's; the slots a branch row's positions read (<= its round's drafting slot), through
    # its source trajectory's features == the fresh forward over the branch
    B = ids.shape[0]
    assert len(pos.rows) > B and pos.aux.shape[:2] == (B, max(len(r) for r in pos.rows))
    for r, row in enumerate(pos.rows):
        if pos.source[r] == r:
            n = len(row) - 1
            assert torch.allclose(pos.aux[r, :n], feats[r][:n], atol=1e-5), f"trajectory {r}"
        else:
            read = int((ctx[pos.row == r] - pos.index[pos.row == r] - 2).max()) + 1
            assert torch.allclose(pos.aux[pos.source[r], :read], feats[r][:read], atol=1e-5), f"branch {r}"


def test_a_head_step_runs_the_target_only_for_the_rollout(target, ragged_prompts):
    """prefill + one verify forward per round: no extra pass over the trajectories for the head's features."""
    ids, mask = ragged_prompts
    head = _head(target).train()
    counting = CountingTarget(target)
    obj = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=1.0, replay=False)
    lm = torch.zeros_like(ids)
    batch = {"input_ids": torch.cat([ids, ids], 1), "attention_mask": torch.cat([mask, mask], 1),
             "loss_mask": torch.cat([lm, lm + 1], 1)}
    batch = {k: torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(v, batch["attention_mask"])])
             for k, v in batch.items()}  # right-padded, as collate makes them: each row's prompt is ids[b]
    try:
        out = obj(batch, Models(head, counting))
        out.loss.mul(out.weight).sum().backward()
        calls = counting.calls
    finally:
        counting.detach_counter()
    with torch.no_grad():  # the same rollout (same seed, prompts, policy) counts its rounds
        ref = speculative_generate(target, Eagle3Drafter(head.eval()), ids, mask, strategy=3, max_new_tokens=10,
                                   temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert obj.state.fresh.stats.new_tokens == int(ref.num_new_tokens.sum())
    assert calls == 1 + len(ref.rounds)
