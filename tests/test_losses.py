"""Properties of the per-token divergences."""
import pytest
import torch

from specdistill.losses import (DIVERGENCES, acceptance_rate, divergence, forward_kl, jsd, neg_log_acceptance,
                                reverse_kl, total_variation)


def _pair(seed=0, n=16, v=11, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale, torch.randn(n, v, generator=g) * scale


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_zero_on_equal_inputs(name):
    p, _ = _pair()
    assert torch.allclose(divergence(name, p, p.clone()), torch.zeros(len(p)), atol=1e-6)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_nonnegative_and_positive_when_different(name):
    p, q = _pair(1)
    d = divergence(name, p, q)
    assert d.shape == (len(p),)
    assert (d >= -1e-6).all() and (d > 1e-4).all()


def test_kl_matches_definition_and_asymmetry():
    p, q = _pair(2, n=4, v=5)
    P, Q = p.softmax(-1), q.softmax(-1)
    assert torch.allclose(forward_kl(p, q), (P * (P / Q).log()).sum(-1), atol=1e-5)
    assert torch.allclose(reverse_kl(p, q), (Q * (Q / P).log()).sum(-1), atol=1e-5)
    assert not torch.allclose(forward_kl(p, q), reverse_kl(p, q))


def test_jsd_endpoints_are_the_kls_and_interior_is_bounded():
    p, q = _pair(3)
    assert torch.allclose(jsd(p, q, beta=0.0), forward_kl(p, q))
    assert torch.allclose(jsd(p, q, beta=1.0), reverse_kl(p, q))
    mid = jsd(p, q, beta=0.5)
    # symmetric JSD is bounded by log 2 and symmetric in its arguments
    assert (mid <= torch.log(torch.tensor(2.0)) + 1e-6).all()
    assert torch.allclose(mid, jsd(q, p, beta=0.5), atol=1e-6)
    # the mixture form at beta -> 0 matches a direct computation of beta*KL(p||m)+(1-beta)*KL(q||m)
    b = 0.2
    P, Q = p.softmax(-1), q.softmax(-1)
    M = b * P + (1 - b) * Q
    ref = b * (P * (P / M).log()).sum(-1) + (1 - b) * (Q * (Q / M).log()).sum(-1)
    assert torch.allclose(jsd(p, q, beta=b), ref, atol=1e-5)
    with pytest.raises(ValueError, match="beta"):
        jsd(p, q, beta=1.5)


def test_tvd_bounds_and_acceptance_identity():
    p, q = _pair(4, scale=6.0)
    tv = total_variation(p, q)
    assert ((tv >= 0) & (tv <= 1)).all()
    assert torch.allclose(acceptance_rate(p, q), 1 - tv, atol=1e-6)
    # disjoint one-hot-like distributions: TV -> 1
    a = torch.full((1, 4), -1e4)
    a[0, 0] = 0
    b = torch.full((1, 4), -1e4)
    b[0, 1] = 0
    assert torch.allclose(total_variation(a, b), torch.ones(1), atol=1e-5)
    assert torch.allclose(neg_log_acceptance(p, p), torch.zeros(len(p)), atol=1e-5)


def test_temperature_flattens_and_unknown_name_fails():
    p, q = _pair(5)
    assert (forward_kl(p, q, temperature=4.0) < forward_kl(p, q)).all()
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence("kl2", p, q)


def test_gradients_flow_to_the_draft_only():
    p, q = _pair(6)
    q.requires_grad_(True)
    for name in DIVERGENCES:
        q.grad = None
        divergence(name, p, q).sum().backward()
        assert q.grad is not None and q.grad.abs().sum() > 0


@pytest.mark.parametrize("temperature,rows", [(1.0, 3), (2.0, 1), (0.7, 100)])
def test_forward_kl_in_row_blocks_has_autograds_values_and_gradient(temperature, rows, monkeypatch):
    """With a gradient to q only, forward_kl runs block by block with its own backward: the values and q's gradient
    of the plain autograd formula, whatever the block size; p gets no gradient."""
    import specdistill.losses.divergences as div

    monkeypatch.setattr(div, "block_rows", lambda width, device: rows)
    g = torch.Generator().manual_seed(0)
    p, q0 = 3 * torch.randn(7, 11, generator=g), 3 * torch.randn(7, 11, generator=g)
    w = torch.randn(7, generator=g)
    q = q0.clone().requires_grad_()
    got = div.forward_kl(p, q, temperature)
    (got * w).sum().backward()
    q_ref = q0.clone().requires_grad_()
    log_p = torch.log_softmax(p / temperature, -1)
    want = (log_p.exp() * (log_p - torch.log_softmax(q_ref / temperature, -1))).sum(-1)
    (want * w).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(q.grad, q_ref.grad, atol=1e-6, rtol=1e-5)
    assert got.grad_fn is not None and "BlockedForwardKL" in type(got.grad_fn).__name__
