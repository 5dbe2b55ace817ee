"""The greedy drafting policy (argmax drafts verified as a one-hot proposal, as vLLM serves EAGLE) is lossless: the
emitted tokens follow p (chi-square, significance 1e-3), acceptance is p(draft), and at T=0 it is greedy decoding."""

import pytest
import torch

from specdistill.decoding import (DRAFT_POLICIES, LMDrafter, Sampler, check_draft_policy, speculative_generate,
                                  target_generate)
from specdistill.decoding.sampling import sample
from specdistill.decoding.tree import Proposal
from specdistill.decoding.verify import verify

N = 20000  # rows per verify call: one vectorized Monte-Carlo batch


def _dist(*values):
    t = torch.tensor(values, dtype=torch.float)
    return t / t.sum()


# p at [pending, d_1, d_2, d_3] (K+1 = 4, V = 8), distinct per position; the drafts are one fixed token per position,
# as an argmax proposal is: p(d) = 1/5, 3/7 and 2/7 at the three drafted positions.
P = torch.stack([_dist(1, 2, 3, 4, 0, 5, 1, 4), _dist(6, 1, 1, 0, 2, 1, 3, 0),
                 _dist(1, 1, 4, 1, 1, 4, 1, 1), _dist(0, 3, 0, 3, 2, 0, 1, 1)])
DRAFTS = torch.tensor([7, 0, 2])


def _verify(p=P, drafts=DRAFTS, seed=0):
    K, V = len(drafts), p.shape[-1]
    return verify(Proposal(drafts.expand(N, K)), target_probs=p.expand(N, K + 1, V),
                  generator=torch.Generator().manual_seed(seed))


def _emitted(v, i):
    """The i-th emitted token of the rows that emitted at least i+1 tokens."""
    return v.tokens[v.num_emitted > i, i]


def test_one_hot_proposal_output_follows_p_at_every_position(chi_square_pvalue):
    v = _verify()
    for i in range(4):  # the first token, later ones (given the earlier drafts were accepted), and the bonus
        tokens = _emitted(v, i)
        assert len(tokens) > 300, i
        assert chi_square_pvalue(torch.bincount(tokens, minlength=8), P[i]) > 1e-3, f"position {i}"
    # acceptance at position k, given it was reached, is p_k(d_k); alpha records exactly that
    assert torch.allclose(v.alpha, P[torch.arange(3), DRAFTS].expand(N, 3))
    reached = torch.ones(N, dtype=torch.bool)
    for k in range(3):
        a = P[k, DRAFTS[k]]
        rate = v.accepted[reached, k].float().mean()
        assert abs(rate - a) < 4.5 * (a * (1 - a) / reached.sum()).sqrt(), f"position {k}: {rate:.4f} vs {a:.4f}"
        reached = v.accepted[:, k]


def test_resampling_from_p_itself_after_a_rejection_fails_the_same_check(chi_square_pvalue):
    # The bug this policy invites: after rejecting the argmax draft, resample from p (the draft can come back)
    # instead of p without it. The check above must catch it, or it could not catch anything.
    v = _verify()
    wrong = torch.where(v.accepted[:, 0], DRAFTS[0], sample(P[0].expand(N, 8), torch.Generator().manual_seed(1)))
    assert chi_square_pvalue(torch.bincount(wrong, minlength=8), P[0]) < 1e-6


def test_never_accepted_when_p_gives_the_draft_no_mass(chi_square_pvalue):
    p = torch.stack([_dist(1, 2, 3, 4, 0, 5, 1, 2)] * 3)  # p(4) = 0
    v = _verify(p, torch.tensor([4, 4]))
    assert not v.accepted.any() and torch.equal(v.alpha, torch.zeros(N, 2))
    assert chi_square_pvalue(torch.bincount(v.next_token, minlength=8), p[0]) > 1e-3  # never 4: p(4) = 0


def test_always_accepted_when_p_is_one_hot_at_the_drafts(chi_square_pvalue):
    drafts = torch.tensor([2, 5, 1])
    p = torch.cat([torch.nn.functional.one_hot(drafts, 8).float(), P[3:]])  # (4, 8): the bonus position is P[3]
    v = _verify(p, drafts)
    assert v.accepted.all() and torch.equal(v.tokens[:, :3], drafts.expand(N, 3))
    assert torch.equal(v.alpha, torch.ones(N, 3))
    assert chi_square_pvalue(torch.bincount(v.next_token, minlength=8), P[3]) > 1e-3


def test_sometimes_accepted_and_a_rejection_never_repeats_the_draft(chi_square_pvalue):
    v = _verify()
    rejected = ~v.accepted[:, 0]
    correction = v.next_token[rejected]                       # sampled from p_0 without d_1, renormalised
    assert 0.7 < rejected.float().mean() < 0.9 and not bool((correction == DRAFTS[0]).any())
    without = P[0].clone()
    without[DRAFTS[0]] = 0
    assert chi_square_pvalue(torch.bincount(correction, minlength=8), without) > 1e-3


def test_policy_names_and_the_draft_sampler():
    assert set(DRAFT_POLICIES) == {"greedy", "sample"}
    with pytest.raises(ValueError, match="greedy.*sample"):
        check_draft_policy("argmax")
    s = Sampler(1.0, 0.9, torch.Generator().manual_seed(0))
    assert s.for_drafts("sample") is s and s.for_drafts("greedy").greedy
    assert Sampler(0.0).for_drafts("sample").greedy  # at T=0 both policies are greedy verification
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    tokens, probs = s.for_drafts("greedy").draw(logits)
    assert probs is None and torch.equal(tokens, logits.argmax(-1))  # one-hot proposal at the argmax


@torch.no_grad()
@pytest.mark.parametrize("policy", DRAFT_POLICIES)
def test_both_policies_are_token_identical_to_target_only_at_temperature_0(policy, tiny_lm, ragged_prompts):
    target, draft = tiny_lm(0), tiny_lm(1)
    ids, mask = ragged_prompts
    ref = target_generate(target, ids, mask, max_new_tokens=20)
    r = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=3, max_new_tokens=20, draft_policy=policy)
    assert torch.equal(r.sequences, ref.sequences)
    assert 0 < int(r.position_accepted.sum()) < int(r.position_proposed.sum())  # accepted and rejected drafts


@torch.no_grad()
def test_greedy_policy_at_temperature_1_drafts_the_argmax(tiny_lm, ragged_prompts):
    """Every draft of every round is the draft model's argmax on its context (prompt + tokens so far + the round's
    earlier drafts), while the target samples: the proposal verification treats as one-hot is the one made."""
    target, draft = tiny_lm(0), tiny_lm(1)
    ids, mask = ragged_prompts
    r = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=3, max_new_tokens=12, temperature=1.0,
                             generator=torch.Generator().manual_seed(0), record=True, draft_policy="greedy")
    checked = 0
    for rnd in r.rounds:
        for b in rnd.active.nonzero().flatten().tolist():
            ctx = torch.cat([ids[b][mask[b].bool()], r.sequences[b, : int(rnd.offset[b])], rnd.draft_tokens[b]])
            logits = draft(ctx[None]).logits[0]                                # (L, V)
            n0 = len(ctx) - rnd.gamma                                          # context length at the first draft
            assert torch.equal(logits[n0 - 1: n0 - 1 + rnd.gamma].argmax(-1), rnd.draft_tokens[b])
            checked += rnd.gamma
    assert checked >= 30 and 0 < int(r.position_accepted.sum()) < int(r.position_proposed.sum())


@pytest.mark.parametrize("K", [0, 1, 4])
def test_one_hot_proposals_verify_as_their_explicit_one_hot_q_draw_for_draw(K):
    """Drafts without probs (the greedy drafting policy) skip building q; the verdict must be the one the general
    path gives the same drafts with q written out one-hot, under the same generator: every accept test, resample and
    alpha. Rows with p(d) = 1 (no residual mass) and rows accepting all K drafts included."""
    g = torch.Generator().manual_seed(3)
    B, V = 64, 11
    p = torch.softmax(3 * torch.randn(B, K + 1, V, generator=g), -1)
    drafts = torch.randint(V, (B, K), generator=g)
    if K:
        p[:8, :K] = torch.nn.functional.one_hot(drafts[:8], V).float()  # always accepted: the bonus from p_K
        p[8:12, 0] = torch.nn.functional.one_hot(drafts[8:12, 0], V).float()
    q = torch.nn.functional.one_hot(drafts, V).float()
    for seed in range(5):
        fast = verify(Proposal(drafts), target_probs=p, generator=torch.Generator().manual_seed(seed))
        full = verify(Proposal(drafts, probs=q), target_probs=p, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(fast.tokens, full.tokens) and torch.equal(fast.num_accepted, full.num_accepted)
        assert torch.equal(fast.alpha, full.alpha)
