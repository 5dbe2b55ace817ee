"""Soft cross-entropy -sum_v p_v log q_v of a draft's distribution q against a target's p, as pure functions: the plain
autograd form on logits, and a fused form that takes the draft's features and output weight, projects them chunk by
chunk and recomputes the softmax in backward, so no (N, V) tensor is kept for backward.

The fused form's work beside its matmuls (two softmaxes, the products, the sums, the argmax over (chunk, V)) reads and
writes the (chunk, V) logits several times when run op by op; with compiled=True it runs as kernels torch.compile
fuses (Triton on CUDA, C++ on the CPU), which read them about once per pass and never build the gathered target rows.
A compiler that fails falls back to the eager ops with a warning.

Shape legend: N = scored tokens, M = target rows (N <= M when `rows` picks them), H = feature width, V = vocabulary.
Both forms read the target as logits (M, V): p = softmax(p_logits) in fp32, row rows[n] for token n. `mask` (N,) bool
zeroes a token's loss and gradient (EAGLE-3: the target's argmax lies outside the draft vocabulary). They return a
per-token value (N,); normalising over tokens is the training loop's job.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from specdistill.flops import counting

CHUNK_BYTES = 128 * 2**20  # the fused form's working set: this many bytes of fp32 (chunk, V) logits at a time


@dataclass
class SoftCrossEntropy:
    loss: torch.Tensor      # (N,) fp32, -sum_v p_v log q_v, 0 where masked
    q_argmax: torch.Tensor  # (N,) long, the draft's most likely token (for accuracy metrics; no gradient)


def _rows_and_mask(p_logits: torch.Tensor, n: int, rows: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) long target rows and (N,) bool mask, defaulted and checked."""
    if rows is None:
        if p_logits.shape[0] != n:
            raise ValueError(f"soft cross-entropy: {n} draft tokens against {p_logits.shape[0]} target rows; pass "
                             "rows (N,) naming each token's target row")
        rows = torch.arange(n, device=device)
    if rows.shape != (n,) or rows.dtype != torch.long:
        raise ValueError(f"soft cross-entropy: rows must be a ({n},) long tensor, got {tuple(rows.shape)} {rows.dtype}")
    if mask is None:
        mask = torch.ones(n, dtype=torch.bool, device=device)
    if mask.shape != (n,):
        raise ValueError(f"soft cross-entropy: mask must be ({n},), got {tuple(mask.shape)}")
    return rows, mask.bool()


def soft_cross_entropy(q_logits: torch.Tensor, p_logits: torch.Tensor, rows: Optional[torch.Tensor] = None,
                       mask: Optional[torch.Tensor] = None) -> SoftCrossEntropy:
    """q_logits (N, V), p_logits (M, V), rows (N,) long, mask (N,) bool -> loss (N,). Plain autograd: keeps the
    fp32 log-softmax (N, V) and the gathered p (N, V) for backward."""
    rows, mask = _rows_and_mask(p_logits, q_logits.shape[0], rows, mask, q_logits.device)
    p = p_logits[rows].float().softmax(-1)                                     # (N, V)
    q_log = F.log_softmax(q_logits.float(), -1)                                # (N, V)
    return SoftCrossEntropy(-(p * q_log).sum(-1) * mask, q_logits.detach().argmax(-1))


def _matmul_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(h, weight) computes in here: autocast's where it is on, else the inputs' common one."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


def _chunk_loss(z: torch.Tensor, p_logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor):
    """One chunk's loss and argmax from its draft logits z (C, V) (any float dtype) and the target's rows. -> (C,) fp32
    loss, (C,) long argmax."""
    p = p_logits[rows].float().softmax(-1)                                      # (C, V)
    return -(p * F.log_softmax(z.float(), -1)).sum(-1) * mask, z.argmax(-1)


def _chunk_grad(z: torch.Tensor, p_logits: torch.Tensor, rows: torch.Tensor, g: torch.Tensor, dtype: torch.dtype):
    """One chunk's gradient in z (C, V), in `dtype`: log_softmax's backward of the upstream gradient -p g,
    g (softmax(z) sum(p) - p), with g (C,) the loss's gradient (masked)."""
    p = p_logits[rows].float().softmax(-1)                                      # (C, V)
    return ((z.float().softmax(-1) * p.sum(-1, keepdim=True) - p) * g[:, None]).to(dtype)


_EAGER = (_chunk_loss, _chunk_grad)


class _Kernels:
    """_chunk_loss and _chunk_grad, eager or compiled (once each, every dimension dynamic: chunks and vocabularies of
    any size share the compiled code)."""

    def __init__(self):
        self.compiled = None
        self.failed: Optional[str] = None

    def get(self, compiled: bool):
        if not compiled or self.failed is not None or counting():  # under the FLOP counter: eager (flops.counting)
            return _EAGER
        if self.compiled is None:
            self.compiled = tuple(torch.compile(fn, dynamic=True) for fn in _EAGER)
        return self.compiled

    def run(self, which: int, compiled: bool, *args):
        fn = self.get(compiled)[which]
        try:
            return fn(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the compiler's failure (no C++ compiler, no Triton): eager from here
            if fn is _EAGER[which]:
                raise
            self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            warnings.warn(f"soft cross-entropy: torch.compile failed ({self.failed}); its element-wise work runs as "
                          "eager ops from here (same values, slower; objective.compile_loss=false says so up front)",
                          stacklevel=2)
            return _EAGER[which](*args)


_KERNELS = _Kernels()


class _LinearSoftCrossEntropy(torch.autograd.Function):
    """loss_n = -sum_v softmax(p_logits[rows_n])_v log_softmax(h_n @ W^T)_v * mask_n, over chunks of tokens, with the
    projection in `dtype` (W cast inside, so no cast copy of it is kept). Saves only h, W, p_logits, rows and mask;
    backward recomputes each chunk's logits and softmax."""

    @staticmethod
    def forward(ctx, h, weight, p_logits, rows, mask, chunk, dtype, compiled):
        # h (N, H) W (V, H) p_logits (M, V) -> loss (N,), argmax (N,)
        N = h.shape[0]
        loss = torch.empty(N, dtype=torch.float32, device=h.device)
        argmax = torch.empty(N, dtype=torch.long, device=h.device)
        w = weight.to(dtype)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, N, chunk):
                e = min(s + chunk, N)
                z = F.linear(h[s:e], w)                                         # (C, V)
                loss[s:e], argmax[s:e] = _KERNELS.run(0, compiled, z, p_logits, rows[s:e], mask[s:e])
        ctx.save_for_backward(h, weight, p_logits, rows, mask)
        ctx.chunk, ctx.dtype, ctx.compiled = chunk, dtype, compiled
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):  # grad_loss (N,)
        h, weight, p_logits, rows, mask = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g = grad_loss.float() * mask                                             # (N,)
        w = weight.to(ctx.dtype)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], ctx.chunk):
                e = min(s + ctx.chunk, h.shape[0])
                z = F.linear(h[s:e], w)                                         # (C, V) as in forward
                dz = _KERNELS.run(1, ctx.compiled, z, p_logits, rows[s:e], g[s:e], ctx.dtype)  # (C, V)
                del z
                if need_h:
                    grad_h[s:e] = dz @ w
                if need_w:
                    grad_w += (dz.T @ h[s:e]).float()
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


def linear_soft_cross_entropy(h: torch.Tensor, weight: torch.Tensor, p_logits: torch.Tensor,
                              rows: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                              chunk: Optional[int] = None, compiled: bool = False) -> SoftCrossEntropy:
    """soft_cross_entropy(F.linear(h, weight), p_logits, rows, mask), fused: the draft logits (N, V) are computed
    `chunk` tokens at a time (default: CHUNK_BYTES of fp32 logits) and never stored; backward recomputes them.
    h (N, H) features, weight (V, H) output layer, p_logits (M, V) target logits (no gradient flows to them),
    rows (N,) long, mask (N,) bool -> loss (N,). Under autocast the projection runs in autocast's dtype, as F.linear
    would, and the softmax in fp32. compiled: the element-wise work as torch.compile's fused kernels (module doc)."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"linear soft cross-entropy: h (N, H) and weight (V, H) expected, got {tuple(h.shape)} and "
                         f"{tuple(weight.shape)}")
    if p_logits.shape[-1] != weight.shape[0]:
        raise ValueError(f"linear soft cross-entropy: target logits over {p_logits.shape[-1]} ids, draft output layer "
                         f"over {weight.shape[0]}: restrict the target to the draft vocabulary first")
    if p_logits.requires_grad:
        raise ValueError("linear soft cross-entropy: the target logits need a gradient, which this loss does not "
                         "compute; detach them (the target is frozen) or use soft_cross_entropy")
    rows, mask = _rows_and_mask(p_logits, h.shape[0], rows, mask, h.device)
    dtype = _matmul_dtype(h, weight)
    chunk = chunk or max(1, CHUNK_BYTES // (4 * weight.shape[0]))
    # h is cast here (autograd records the cast, which keeps nothing), so the function keeps it in the projection's
    # dtype, as F.linear under autocast keeps its input
    loss, argmax = _LinearSoftCrossEntropy.apply(h.to(dtype), weight, p_logits, rows, mask, chunk, dtype, compiled)
    return SoftCrossEntropy(loss, argmax)
