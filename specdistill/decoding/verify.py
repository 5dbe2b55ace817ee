"""Draft verification on tensors: greedy matching and exact speculative sampling (Leviathan et al. 2023; Chen et al.
2023).

Shapes: B rows, K drafted tokens, V vocab. The target scored [pending, d_1, ..., d_K] in one forward, so its
row k (k < K) is the distribution of draft position k and its row K is the bonus position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .sampling import sample, uniform

PAD = -1  # fills Verdict.tokens after the next token; never a real token id


@dataclass
class Verdict:
    accepted: torch.Tensor      # (B, K) bool, True for the drafted positions before the first rejection
    num_accepted: torch.Tensor  # (B,) long
    next_token: torch.Tensor    # (B,) long, the correction at the first rejection, or the bonus after K accepts
    alpha: torch.Tensor         # (B, K) float, sum_x min(p, q) = 1 - TV(p, q): the acceptance probability
    tokens: torch.Tensor        # (B, K+1) long, accepted drafts then next_token, then PAD

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1  # (B,)


def _check(draft_tokens: torch.Tensor, target: torch.Tensor) -> None:
    B, K = draft_tokens.shape
    if target.dim() != 3 or target.shape[:2] != (B, K + 1):
        raise ValueError(f"target scores must be (B, K+1, V) = ({B}, {K + 1}, V) for drafts "
                         f"{tuple(draft_tokens.shape)}, got {tuple(target.shape)}: score [pending, d_1..d_K] in one "
                         "forward")


def _finish(draft_tokens: torch.Tensor, ok: torch.Tensor, next_of: Callable[[torch.Tensor], torch.Tensor],
            alpha: torch.Tensor) -> Verdict:
    """ok (B, K): per-position accept test -> accepted prefix, counts, and the emitted tokens."""
    accepted = ok.long().cumprod(dim=1).bool()                              # (B, K) True until the first failure
    num_accepted = accepted.sum(1)                                          # (B,)
    next_token = next_of(num_accepted)                                      # (B,)
    tokens = F.pad(torch.where(accepted, draft_tokens, PAD), (0, 1), value=PAD)  # (B, K+1)
    tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return Verdict(accepted, num_accepted, next_token, alpha, tokens)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Accept while the draft equals the target's argmax; the next token is the target's argmax after that."""
    _check(draft_tokens, target_logits)
    K = draft_tokens.shape[1]
    top = target_logits.argmax(-1)                                          # (B, K+1)
    match = draft_tokens == top[:, :K]                                      # (B, K)
    # Greedy p and q are one-hot: sum_x min(p, q) is 1 when they pick the same token, else 0.
    return _finish(draft_tokens, match, lambda n: top.gather(1, n[:, None]).squeeze(1), match.float())


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Speculative sampling: the emitted tokens are distributed exactly as the target's p.

    draft_tokens (B, K) were drawn from draft_probs q (B, K, V); None means a deterministic draft (q one-hot at the
    drafts: the greedy drafting policy, sampling.DRAFT_POLICIES): then d_k is accepted with probability p_k(d_k) and a
    rejection resamples from p_k with d_k removed, renormalised (max(0, p - onehot) below), alpha_k = p_k(d_k).
    target_probs p (B, K+1, V) come from the same temperature / top-p processing as q.
    """
    _check(draft_tokens, target_probs)
    B, K = draft_tokens.shape
    V = target_probs.shape[-1]
    p = target_probs.float()                                                # (B, K+1, V)
    q = F.one_hot(draft_tokens, V).float() if draft_probs is None else draft_probs.float()  # (B, K, V)
    p_draft = p[:, :K]                                                      # (B, K, V)

    # 1. Accept d_k ~ q_k with probability min(1, p_k(d_k) / q_k(d_k)), all positions at once.
    px = p_draft.gather(-1, draft_tokens[..., None]).squeeze(-1)            # (B, K)
    qx = q.gather(-1, draft_tokens[..., None]).squeeze(-1)                  # (B, K)
    ok = uniform((B, K), generator, p.device) * qx < px                     # u < p/q, and never when p(d) = 0

    # 2. The next token, at n = number accepted: resample from norm(max(0, p_n - q_n)) after a rejection,
    #    or draw the bonus from p_K when all K were accepted (q_K = 0 makes the same formula give p_K).
    def next_of(n: torch.Tensor) -> torch.Tensor:
        p_n = p.gather(1, n[:, None, None].expand(B, 1, V)).squeeze(1)     # (B, V)
        q_n = torch.zeros_like(p_n)
        if K > 0:
            q_n = q.gather(1, n.clamp(max=K - 1)[:, None, None].expand(B, 1, V)).squeeze(1)
            q_n = q_n * (n < K)[:, None]
        residual = (p_n - q_n).clamp(min=0)                                 # (B, V), normalized by sample()
        # p == q leaves no residual mass; a rejection there is a rounding artifact: p is the residual's limit.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
        return sample(residual, generator)

    alpha = torch.minimum(p_draft, q).sum(-1)                               # (B, K)
    return _finish(draft_tokens, ok, next_of, alpha)
