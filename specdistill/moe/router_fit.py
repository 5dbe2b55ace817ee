"""Routers for a converted MoE: a linear scorer on the MLP input that ranks a token's expert groups by the norm of
their true output (ridge regression, closed form), and the recall that says how well a router ranks them.

Knows nothing about models or files: tensors in, tensors out.
"""
from __future__ import annotations

import torch


def group_output_norms(h: torch.Tensor, down: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """||down[:, g] @ h[:, g]|| per token and group.
    h: (N, I) neuron activations act(gate x) * up x; down: (H, I); groups: (E, G) neuron ids -> (N, E)."""
    return torch.stack([(h[:, g] @ down[:, g].T).norm(dim=-1) for g in groups], dim=1)


def fit_router(x: torch.Tensor, norms: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """Ridge regression of each token's centred log group-output norms on its MLP input -> router weight (E, H).

    x: (N, H) MLP inputs; norms: (N, E) true group output norms. Only the per-token ranking of groups decides the
    top-k, so the target is log-norm minus its per-token mean (a token's overall scale is not a routing signal).
    HF MoE routers (Mixtral, Qwen-MoE, OLMoE) have no bias, so the fit goes through the origin. `ridge` is relative
    to the mean eigenvalue of x^T x (scale-free)."""
    if x.shape[0] != norms.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens but norms has {norms.shape[0]}")
    y = norms.double().clamp_min(1e-12).log()
    y = y - y.mean(dim=1, keepdim=True)  # (N, E)
    xd = x.double()
    xtx = xd.T @ xd  # (H, H)
    lam = ridge * xtx.diagonal().mean().clamp_min(1e-12)
    w = torch.linalg.solve(xtx + lam * torch.eye(xtx.shape[0], dtype=xtx.dtype), xd.T @ y)  # (H, E)
    return w.T.to(x.dtype).contiguous()


def scale_to_spread(weight: torch.Tensor, x: torch.Tensor, spread: float) -> torch.Tensor:
    """Rescale a router (E, H) so its logits on x (N, H) have a mean per-token std of `spread` across experts.
    A positive scale keeps every token's ranking (its top-k); it only sets how far the softmax weights are from
    uniform (see moe/convert.py: near-uniform weights keep the converted MoE close to the dense sum)."""
    std = (x @ weight.T).std(dim=1).mean()  # x @ W^T: (N, E)
    return weight * (spread / std.clamp_min(1e-12))


def topk_recall(scores: torch.Tensor, norms: torch.Tensor, k: int) -> float:
    """Mean share of a token's router top-k that is among its k groups with the largest true output.
    scores, norms: (N, E). A random router scores k / E on average; a perfect one 1."""
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True)
    best = torch.zeros_like(norms, dtype=torch.bool).scatter_(1, norms.topk(k, dim=1).indices, True)
    return float((picked & best).sum(dim=1).double().mean() / k)
