"""probs_from_logits / sample / Sampler: greedy is one-hot, top-p keeps the nucleus, sampling matches probs."""

import pytest
import torch

from specdistill.decoding.sampling import Sampler, probs_from_logits, sample


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    probs = probs_from_logits(logits, temperature=0.0, top_p=0.5)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3, 5))
    assert set(probs.unique().tolist()) == {0.0, 1.0}


def test_top_p_one_is_tempered_softmax():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    for t in (0.5, 1.0, 2.0):
        assert torch.allclose(probs_from_logits(logits, t, 1.0), torch.softmax(logits / t, -1))


def test_top_p_keeps_smallest_nucleus_and_renormalizes():
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    out = probs_from_logits(probs.log(), temperature=1.0, top_p=0.75)
    # Sorted: 0.4, 0.3 (cum 0.7 < 0.75), 0.15 (cum 0.85 >= 0.75): keep {1, 3, 4}.
    expected = torch.tensor([[0.0, 0.4, 0.0, 0.3, 0.15]]) / 0.85
    assert torch.allclose(out, expected, atol=1e-6)
    # A tiny top_p still keeps the top token.
    assert torch.equal(probs_from_logits(probs.log(), 1.0, 1e-6), torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("temperature, top_p", [(-0.1, 1.0), (1.0, 0.0), (1.0, 1.5)])
def test_bad_sampling_arguments_raise(temperature, top_p):
    with pytest.raises(ValueError):
        probs_from_logits(torch.zeros(2, 3), temperature, top_p)
    with pytest.raises(ValueError):
        Sampler(temperature, top_p)


def test_sample_matches_probs_and_never_picks_zero_mass(chi_square_pvalue):
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    tokens = sample(probs.expand(20000, 6), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6)
    assert counts[probs == 0].sum() == 0
    assert chi_square_pvalue(counts, probs) > 1e-3
    # Same generator seed, same tokens: deterministic.
    assert torch.equal(tokens, sample(probs.expand(20000, 6), torch.Generator().manual_seed(0)))


def test_sampler_draw_greedy_returns_argmax_and_no_probs():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(2))
    tokens, probs = Sampler(0.0).draw(logits)
    assert probs is None and torch.equal(tokens, logits.argmax(-1))
    tokens, probs = Sampler(1.0, 0.9, torch.Generator().manual_seed(0)).draw(logits)
    assert probs.shape == (5, 7) and bool((probs.gather(1, tokens[:, None]) > 0).all())
