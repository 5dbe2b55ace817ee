"""Simulated acceptance during training: teacher-forced agreement runs between draft and target (a fast proxy).

At each held-out loss position t, the draft "agrees" if its argmax equals the target's argmax. A chain started at
t is accepted for k steps if positions t..t+k-1 all agree (and are loss positions). Then
a_k = #chains reaching k / #chains reaching k-1 and tau_sim = 1 + sum_k prod_{i<=k} a_i (capped at gamma).
This ignores that at inference the draft conditions on its own tokens; the real number is scripts/evaluate.py's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class SimulatedAcceptance:
    gamma: int
    accept_rate_per_pos: list[float]  # a_k, k = 1..gamma
    mean_accept_len: float  # tau_sim = 1 + sum_k prod_{i<=k} a_i
    top1_agreement: float  # a_1: share of loss positions where draft argmax == target argmax
    num_positions: int

    def to_dict(self) -> dict:
        return asdict(self)


def chain_counts(match: torch.Tensor, valid: torch.Tensor, gamma: int) -> torch.Tensor:
    """match, valid: (B, T) bool. Returns reached (gamma+1,): reached[k] = #starts whose next k positions all
    agree (reached[0] = #valid starts). Summed counts, so ratios can be taken after reducing over batches/ranks."""
    ok = valid.clone()  # (B, T) chains alive at depth 0
    reached = [ok.sum()]
    good = match & valid
    T = match.shape[1]
    for k in range(gamma):
        shifted = torch.zeros_like(good)
        shifted[:, : T - k] = good[:, k:]  # position t+k agrees
        ok = ok & shifted
        reached.append(ok.sum())
    return torch.stack(reached)


def summarize(reached: torch.Tensor, gamma: int) -> SimulatedAcceptance:
    reached = reached.double().cpu()
    n0 = max(reached[0].item(), 1.0)
    rates = [(reached[k] / reached[k - 1]).item() if reached[k - 1] > 0 else 0.0 for k in range(1, gamma + 1)]
    tau = 1.0 + (reached[1:] / n0).sum().item()
    return SimulatedAcceptance(gamma, rates, tau, rates[0] if rates else 0.0, int(reached[0].item()))


def eagle3_chain_counts(head, target_out, batch: dict, gamma: int) -> torch.Tensor:
    """EAGLE-3 heads: unroll gamma steps on the head's own features (as the TTT objective does); a chain started at
    slot t reaches k if steps 0..k-1 all predict the target's argmax for tokens t+2..t+1+k. Same counts as above."""
    from specdistill.objectives.eagle3 import shift_left

    lm = batch["loss_mask"].bool()
    step_logits = head(target_out.aux_hidden, batch["input_ids"], batch["attention_mask"], steps=gamma)
    inner = getattr(head, "module", head)
    target_argmax = target_out.logits.argmax(-1)  # (B, T)
    ok = shift_left(lm, 1)  # chains start at slots whose first prediction is a loss position
    reached = [ok.sum()]
    for j, q in enumerate(step_logits):
        hit = inner.draft_to_target(q.argmax(-1)) == shift_left(target_argmax, 1 + j, fill=-1)
        ok = ok & hit & shift_left(lm, 1 + j, fill=False)
        reached.append(ok.sum())
    return torch.stack(reached)


@torch.no_grad()
def simulated_acceptance(draft, target, batches, gamma: int, reduce=lambda t: t) -> SimulatedAcceptance:
    """batches: iterable of collated dicts on the right device. `reduce` sums tensors over ranks.
    Works for standalone causal-LM drafts and EAGLE-3 heads (dispatch on the draft's type)."""
    from specdistill.models.eagle3 import is_eagle3

    was_training = draft.training
    draft.eval()
    eagle = is_eagle3(getattr(draft, "module", draft))
    total = None
    for batch in batches:
        p = target(batch["input_ids"], batch["attention_mask"])
        if eagle:
            counts = eagle3_chain_counts(draft, p, batch, gamma)
        else:
            q = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
            match = q.argmax(-1) == p.logits.argmax(-1)  # (B, T)
            counts = chain_counts(match, batch["loss_mask"].bool(), gamma)
        total = counts if total is None else total + counts
    draft.train(was_training)
    if total is None:
        return SimulatedAcceptance(gamma, [0.0] * gamma, 1.0, 0.0, 0)
    return summarize(reduce(total), gamma)
