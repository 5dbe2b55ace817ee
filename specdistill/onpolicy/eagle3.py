"""Draft-OPD for EAGLE-3 heads (arXiv 2605.29343 on arXiv 2503.01840): rollouts through Eagle3Drafter, and the
with-grad loss forward as the head's training-time-test unroll on its own features, exactly as at inference.

Bookkeeping (models/eagle3.py, decoding/eagle3_drafter.py): with context x_0 .. x_{N-1} (x_{N-1} pending), the head drafts
d_1 from slot N-2 (target feature g_{N-2} with token x_{N-1}), and draft step i stays on slot N-2, feeds d_i with the
head's own previous output, RoPE position N-2+i. The TTT unroll `head(aux, ids, mask, steps)` computes exactly this at
every slot t and step j (slot t, step j reads token t+1+j): drafted position i of a round whose context has N tokens
is step i at slot N-2 of a row whose tokens N .. N+i-1 are d_1 .. d_i. On-trajectory positions read the final
trajectory; positions after a rejection read their round's branch row (the rejected draft in place), whose slots
<= N-2 carry the trajectory's target features (only those are read: step-0 attention is causal, later steps only
see their own slot).

The target's aux hidden states for the rows come from one extra no-grad target forward over the final trajectories
per rollout (counted in RolloutStats.target_tokens). The loss compares q over the draft vocabulary with the target's
distribution restricted to it (renormalised), masking positions whose target argmax lies outside it, as the eagle3
objective does; acceptance (weights, priorities) uses the full p against q scattered to target ids, as verification.
"""
from __future__ import annotations

import torch

from specdistill.decoding import Eagle3Drafter, probs_from_logits, speculative_generate


def target_aux(target_model, rows: list[torch.Tensor], source: list[int], aux_layer_ids: list[int],
               pad_id: int) -> torch.Tensor:
    """(R, L, n_aux * Ht) right-padded: the target's aux hidden states over the trajectories (rows whose source is
    themselves), copied into the branch rows from their source trajectory."""
    trajs = [r for r, s in enumerate(source) if s == r]
    L = max(len(r) for r in rows)
    device = rows[0].device
    ids = torch.full((len(trajs), L), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(trajs), L, dtype=torch.long, device=device)
    for k, r in enumerate(trajs):
        ids[k, : len(rows[r])], mask[k, : len(rows[r])] = rows[r], 1
    with torch.no_grad():
        out = target_model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False,
                           logits_to_keep=1)
    feats = torch.cat([out.hidden_states[k] for k in aux_layer_ids], dim=-1)  # (B, L, n_aux * Ht)
    where = {r: k for k, r in enumerate(trajs)}
    return feats[[where[s] for s in source]]                                   # (R, L, n_aux * Ht)


@torch.no_grad()
def eagle3_rollout(target_model, head, prompt_ids, prompt_mask, *, gamma, max_new_tokens, temperature, eos_token_id,
                   generator, pad_id, top_k, branches):
    from specdistill.onpolicy.rollout import positions_from_rounds

    if int(prompt_mask.sum(1).min()) < 2:
        raise ValueError("EAGLE-3 rollouts need prompts of at least 2 tokens (the head drafts from the target's "
                         "features of the token before the pending one)")
    rollout = speculative_generate(target_model, Eagle3Drafter(head), prompt_ids, prompt_mask, gamma=gamma,
                                   max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos_token_id,
                                   generator=generator, record=True)
    pos = positions_from_rounds(prompt_ids, prompt_mask, rollout, top_k, branches)
    pos.aux = target_aux(target_model, pos.rows, pos.source, list(head.config.aux_layer_ids), pad_id)
    pos.stats.target_tokens += sum(len(pos.rows[r]) for r in range(len(pos.rows)) if pos.source[r] == r)
    return pos


def eagle3_logits_at(head, rows: list[torch.Tensor], aux: torch.Tensor, row: torch.Tensor, context_len: torch.Tensor,
                     index: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(P, Vd) the head's draft-vocabulary logits at each drafted position, WITH grad: one TTT unroll of
    max(index)+1 steps over all rows (right-padded), read at slot context_len - index - 2, step index."""
    L = aux.shape[1]
    device = aux.device
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), L, dtype=torch.long, device=device)
    for k, r in enumerate(rows):
        ids[k, : len(r)], mask[k, : len(r)] = r, 1
    steps = int(index.max()) + 1
    step_logits = torch.stack(head(aux, ids, mask, steps=steps))             # (steps, R, L, Vd)
    slot = context_len - index - 2
    return step_logits[index, row, slot]                                     # (P, Vd)


def restrict_to_draft_vocab(p_logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits (P, V) -> logits over the draft vocabulary (P, Vd) (softmax = p restricted, renormalised) and
    (P,) whether the target's argmax lies in the draft vocabulary."""
    return p_logits[:, t2d], t2d[p_logits.argmax(-1)]


def eagle3_alpha(p_logits: torch.Tensor, q_logits: torch.Tensor, t2d: torch.Tensor, temperature: float,
                 ) -> torch.Tensor:
    """sum_x min(p, q) as verification sees it: full p (P, V) against q (P, Vd) placed on its target ids (zero
    elsewhere), both after the decoder's processing at `temperature`. (P,)"""
    p = probs_from_logits(p_logits, temperature)[:, t2d]                     # (P, Vd): p on the draft's ids
    q = probs_from_logits(q_logits, temperature)                             # (P, Vd)
    return torch.minimum(p, q).sum(-1)


def check_head(head, target_model) -> None:
    V = target_model.config.vocab_size
    if head.config.vocab_size != V:
        raise ValueError(f"EAGLE-3 head vocab {head.config.vocab_size} != target vocab {V}: warm-start only from a "
                         "head trained for this target")
