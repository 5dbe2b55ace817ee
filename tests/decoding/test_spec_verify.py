"""Verification of chains: greedy matching rules, and speculative sampling preserves p (chi-square) with acceptance
sum min(p, q). Trees: test_tree_verify.py."""

import pytest
import torch

from specdistill.decoding.sampling import probs_from_logits, sample
from specdistill.decoding.tree import Proposal
from specdistill.decoding.verify import PAD, verify

N = 20000  # rows per verify call: one vectorized Monte-Carlo batch


def _dist(*values):
    t = torch.tensor(values, dtype=torch.float)
    return t / t.sum()


def _one_hot_logits(tokens, V=6):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()[None]  # (1, K+1, V)


# ---------------------------------------------------------------------------------------------- greedy
def test_greedy_accepts_until_first_mismatch():
    target_top = [[1, 2, 3, 4], [1, 5, 3, 4], [0, 2, 3, 4]]  # argmax at [pending, d1, d2, d3]
    logits = torch.cat([_one_hot_logits(row) for row in target_top])  # (3, 4, 6)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    v = verify(Proposal(drafts), logits)
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert v.next_token.tolist() == [4, 5, 0]  # bonus, correction, correction
    assert v.accepted.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    assert v.tokens.tolist() == [[1, 2, 3, 4], [1, 5, PAD, PAD], [0, PAD, PAD, PAD]]
    # alpha from one-hot p and q: 1 where the tokens agree, even after the first rejection.
    assert v.alpha.tolist() == [[1, 1, 1], [1, 0, 1], [0, 1, 1]]
    assert v.num_emitted.tolist() == [4, 2, 1]


def test_greedy_with_zero_drafts_emits_the_target_argmax():
    logits = torch.randn(4, 1, 10, generator=torch.Generator().manual_seed(0))
    v = verify(Proposal(torch.zeros(4, 0, dtype=torch.long)), logits)
    assert v.num_accepted.tolist() == [0] * 4 and torch.equal(v.next_token, logits[:, 0].argmax(-1))


def test_sampling_with_one_hot_distributions_equals_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5, 12, generator=g)
    drafts = torch.where(torch.rand(64, 4, generator=g) < 0.7, logits[:, :4].argmax(-1),
                         torch.randint(0, 12, (64, 4), generator=g))
    greedy = verify(Proposal(drafts), logits)
    sampled = verify(Proposal(drafts), target_probs=probs_from_logits(logits, 0.0), generator=g)
    assert torch.equal(greedy.accepted, sampled.accepted) and torch.equal(greedy.next_token, sampled.next_token)
    assert torch.equal(greedy.alpha, sampled.alpha)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="K\\+1"):
        verify(Proposal(torch.zeros(2, 3, dtype=torch.long)), torch.zeros(2, 3, 8))


# ---------------------------------------------------------------------------------------------- sampling
P = torch.stack([_dist(1, 2, 3, 4, 0, 5, 1, 2), _dist(6, 1, 1, 0, 2, 1, 3, 1),
                 _dist(1, 1, 4, 1, 1, 4, 1, 1), _dist(0, 3, 0, 3, 2, 0, 1, 1)])  # (K+1=4, V=8), distinct per position
Q_SOMETIMES = torch.stack([_dist(4, 1, 1, 1, 3, 1, 0, 1), _dist(1, 3, 1, 2, 1, 1, 1, 4), _dist(2, 1, 1, 3, 1, 1, 2, 1)])


def _run(q, p=P, seed=0):
    g = torch.Generator().manual_seed(seed)
    K, V = q.shape
    drafts = sample(q.expand(N, K, V), g)          # d_k ~ q_k
    return drafts, verify(Proposal(drafts, q.expand(N, K, V)), target_probs=p.expand(N, K + 1, V), generator=g)


def _emitted(v, i):
    """The i-th emitted token of the rows that emitted at least i+1 tokens."""
    rows = v.num_emitted > i
    return v.tokens[rows, i]


def test_output_follows_p_at_every_position(chi_square_pvalue):
    _, v = _run(Q_SOMETIMES)
    for i in range(4):  # first position, later positions (given the earlier ones accepted), bonus
        tokens = _emitted(v, i)
        assert len(tokens) > 500
        assert chi_square_pvalue(torch.bincount(tokens, minlength=8), P[i]) > 1e-3, f"position {i}"
    bonus = v.next_token[v.num_accepted == 3]
    assert chi_square_pvalue(torch.bincount(bonus, minlength=8), P[3]) > 1e-3


def test_monte_carlo_acceptance_matches_sum_min():
    _, v = _run(Q_SOMETIMES)
    alpha = torch.minimum(P[:3], Q_SOMETIMES).sum(-1)  # (K,)
    assert torch.allclose(v.alpha, alpha.expand(N, 3))
    reached = torch.ones(N, dtype=torch.bool)
    for k in range(3):  # acceptance at position k, given positions < k were accepted
        rate = v.accepted[reached, k].float().mean()
        sigma = (alpha[k] * (1 - alpha[k]) / reached.sum()).sqrt()
        assert abs(rate - alpha[k]) < 4.5 * sigma, f"position {k}: {rate:.4f} vs {alpha[k]:.4f}"
        reached = v.accepted[:, k]


def test_never_accepted_with_disjoint_supports(chi_square_pvalue):
    p = torch.stack([_dist(0, 0, 0, 0, 1, 2, 3, 4)] * 3)
    q = torch.stack([_dist(1, 1, 1, 1, 0, 0, 0, 0)] * 2)
    _, v = _run(q, p)
    assert not v.accepted.any() and torch.equal(v.alpha, torch.zeros(N, 2))
    assert chi_square_pvalue(torch.bincount(v.next_token, minlength=8), p[0]) > 1e-3


def test_always_accepted_when_q_equals_p(chi_square_pvalue):
    drafts, v = _run(P[:3])
    assert v.accepted.all() and torch.equal(v.tokens[:, :3], drafts)
    assert torch.allclose(v.alpha, torch.ones(N, 3))
    assert chi_square_pvalue(torch.bincount(v.next_token, minlength=8), P[3]) > 1e-3


def test_degenerate_residual_falls_back_to_p():
    # p <= q everywhere (q slightly unnormalized): max(0, p - q) is all zero at the rejection.
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])[None].expand(16, 2, 3)
    q = torch.tensor([[0.01, 1.0, 0.0]])[None].expand(16, 1, 3)
    v = verify(Proposal(torch.zeros(16, 1, dtype=torch.long), q), target_probs=p,
               generator=torch.Generator().manual_seed(0))
    assert not v.accepted.any() and v.next_token.tolist() == [1] * 16


def test_a_wrong_sampler_fails_the_same_check(chi_square_pvalue):
    # The classic bug: after a rejection, resample from p instead of norm(max(0, p - q)). The chi-square
    # test used above must catch it, or it could not catch anything.
    drafts, v = _run(Q_SOMETIMES)
    wrong = torch.where(v.accepted[:, 0], drafts[:, 0], sample(P[0].expand(N, 8), torch.Generator().manual_seed(1)))
    assert chi_square_pvalue(torch.bincount(wrong, minlength=8), P[0]) < 1e-6
    # And a deterministic draft (q one-hot, None) is still exact.
    g = torch.Generator().manual_seed(3)
    v = verify(Proposal(torch.full((N, 1), 2)), target_probs=P[:2].expand(N, 2, 8), generator=g)
    assert abs(v.accepted.float().mean() - P[0, 2]) < 0.015
    assert chi_square_pvalue(torch.bincount(v.tokens[:, 0], minlength=8), P[0]) > 1e-3
