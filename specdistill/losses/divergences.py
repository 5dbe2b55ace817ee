"""Per-token divergences between the target's distribution p and the draft's q, as pure functions.

Shape legend: N = tokens (any leading shape works), V = vocabulary. Every function takes logits (N, V) for the
target (`p_logits`) and the draft (`q_logits`) and returns a per-token value (N,). Normalisation over tokens is
the training loop's job (one division by the global count of loss tokens).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdistill.tensors import block_rows

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd", "acceptance")


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # x / 1.0 is x: at temperature 1 the division would only add a full-size pass (and one more in backward)
    logits = logits.float()
    return F.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return F.softmax(logits if temperature == 1 else logits / temperature, dim=-1)


def forward_kl(p_logits, q_logits, temperature: float = 1.0) -> torch.Tensor:
    """KL(p || q) = sum_x p (log p - log q): mass-covering; the classic KD loss. (N,)
    With a gradient to q only (a frozen target), by _BlockedForwardKL: the same values, no (N, V) tensor kept."""
    if torch.is_grad_enabled() and q_logits.requires_grad and not p_logits.requires_grad and q_logits.dim() == 2:
        return _BlockedForwardKL.apply(p_logits, q_logits, temperature,
                                       block_rows(q_logits.shape[-1], q_logits.device))
    log_p, log_q = _log_probs(p_logits, temperature), _log_probs(q_logits, temperature)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class _BlockedForwardKL(torch.autograd.Function):
    """forward_kl(p_logits (N, V), q_logits (N, V)) -> (N,) a block of `rows` rows at a time, the gradient to q_logits
    only: d/dq = g (softmax(q / T) - softmax(p / T)) / T, recomputed per block in backward. Autograd's form keeps four
    (N, V) fp32 tensors for backward (both log-softmaxes, p, log p - log q) and allocates them whole; this keeps only
    the two logits it was given, and its temporaries are one block's (tensors.block_rows)."""

    @staticmethod
    def forward(ctx, p_logits, q_logits, temperature: float, rows: int):
        out = torch.empty(q_logits.shape[0], dtype=torch.float32, device=q_logits.device)  # (N,)
        for s in range(0, len(out), rows):
            log_p = _log_probs(p_logits[s: s + rows], temperature)                             # (n, V)
            out[s: s + rows] = (log_p.exp() * (log_p - _log_probs(q_logits[s: s + rows], temperature))).sum(-1)
        ctx.save_for_backward(p_logits, q_logits)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad):  # grad (N,)
        p_logits, q_logits = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        grad_q = torch.empty_like(q_logits)                                                   # (N, V)
        g = grad.float()[:, None] if T == 1 else grad.float()[:, None] / T                    # (N, 1)
        for s in range(0, len(grad_q), rows):
            e = s + rows
            q = _probs(q_logits[s:e], T)                                                     # (n, V)
            grad_q[s:e] = q.sub_(_probs(p_logits[s:e], T)).mul_(g[s:e])
        return None, grad_q, None, None


def reverse_kl(p_logits, q_logits, temperature: float = 1.0) -> torch.Tensor:
    """KL(q || p) = sum_x q (log q - log p): mode-seeking. (N,)"""
    log_p, log_q = _log_probs(p_logits, temperature), _log_probs(q_logits, temperature)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def jsd(p_logits, q_logits, beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence (GKD, Agarwal et al. 2024), TRL's convention. (N,)

    m = beta * p + (1 - beta) * q;  JSD_beta = beta * KL(p || m) + (1 - beta) * KL(q || m).
    The mixture form vanishes at both ends, so beta = 0 and beta = 1 are defined as forward KL(p||q) and
    reverse KL(q||p), the limits a user asking for "beta 0 / beta 1" means.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must lie in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(p_logits, q_logits, temperature)
    if beta == 1.0:
        return reverse_kl(p_logits, q_logits, temperature)
    log_p, log_q = _log_probs(p_logits, temperature), _log_probs(q_logits, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + torch.log(torch.tensor(beta)),
                                         log_q + torch.log(torch.tensor(1.0 - beta))]), dim=0)  # (N, V)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_pm + (1.0 - beta) * kl_qm


def total_variation(p_logits, q_logits, temperature: float = 1.0) -> torch.Tensor:
    """TV(p, q) = 1/2 sum_x |p - q| in [0, 1]; 1 - TV is the speculative acceptance rate alpha. (N,)"""
    p = _log_probs(p_logits, temperature).exp()
    q = _log_probs(q_logits, temperature).exp()
    return 0.5 * (p - q).abs().sum(-1)


def acceptance_rate(p_logits, q_logits, temperature: float = 1.0) -> torch.Tensor:
    """alpha = sum_x min(p, q): the probability speculative sampling accepts the draft's token. (N,)"""
    p = _log_probs(p_logits, temperature).exp()
    q = _log_probs(q_logits, temperature).exp()
    return torch.minimum(p, q).sum(-1)


def neg_log_acceptance(p_logits, q_logits, temperature: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """-log alpha: an acceptance-aware loss (the "LK" loss, arXiv 2602.23881). (N,)"""
    return -torch.log(acceptance_rate(p_logits, q_logits, temperature).clamp_min(eps))


def divergence(name: str, p_logits, q_logits, *, beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Dispatch by name: fkl | rkl | jsd | tvd | acceptance (-log sum min(p, q)). (N,)"""
    if name == "fkl":
        return forward_kl(p_logits, q_logits, temperature)
    if name == "rkl":
        return reverse_kl(p_logits, q_logits, temperature)
    if name == "jsd":
        return jsd(p_logits, q_logits, beta, temperature)
    if name == "tvd":
        return total_variation(p_logits, q_logits, temperature)
    if name == "acceptance":
        return neg_log_acceptance(p_logits, q_logits, temperature)
    raise ValueError(f"unknown divergence {name!r}; choose one of {DIVERGENCES}")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy -log q(label). logits (N, V), labels (N,) -> (N,)"""
    return F.cross_entropy(logits.float(), labels, reduction="none")
