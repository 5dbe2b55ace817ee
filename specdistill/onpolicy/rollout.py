"""Draft-OPD rollouts (arXiv 2605.29343): speculative decoding with the current draft, kept position by position.

A rollout runs the evaluator's own decoder (decoding.speculative_generate, record=True): per round the draft proposes
K tokens, the target verifies them in one forward, and the target's correction or bonus token keeps the trajectory
on the target's distribution ("target-assisted"). Every drafted position becomes a training position with what the
loss needs: its context, the drafted token, the target's distribution there, the verifier's decision and category.

Categories of drafted position i (0-based) of a round that accepted n drafts:
  ACCEPTED         i < n    context = the final trajectory up to the round start + d_1..d_i
  FIRST_REJECTED   i == n   same context (d_1..d_n were accepted): still on the final trajectory
  AFTER_REJECTION  i > n    context holds the rejected d_{n+1}: it is OFF the final trajectory

Contexts are stored as token rows plus a length: position p reads rows[row[p]][:context_len[p]]. Rows 0..B-1 are the
final trajectories (prompt + generated tokens); positions after a rejection get one extra row per round, the
round's "branch" = trajectory up to d_n + the round's drafts d_{n+1}..d_{K-1}, so the loss forward sees exactly
the context the draft saw when it proposed them (choice documented in objectives/draft_opd.py).

Without assistance (assist=False, the ablation) the draft decodes alone (decoding.target_generate on the draft) and the
target scores the finished sequences in one forward; the verifier is then run on consecutive blocks of gamma
positions to tag them as a round would, but nothing corrects the trajectory.
"""
from __future__ import annotations

from typing import Optional

import torch

from specdistill.decoding import (DEFAULT_DRAFT_POLICY, CacheMode, Proposal, draft_temperature, probs_from_logits,
                                  speculative_generate, target_generate, verify)
from specdistill.decoding.tree import TreeShape
from specdistill.drafts import draft_adapter
from specdistill.onpolicy.positions import (ACCEPTED, AFTER_REJECTION, FIRST_REJECTED, DraftedPositions,
                                           RolloutStats, TargetLogits, assemble_positions, positions_from_rounds,
                                           trajectories, trajectory_features)
from specdistill.output_positions import output_position_buckets
from specdistill.tensors import pad_rows, position_ids


# ----------------------------------------------------------------------------------------------- prompts
def prompts_from_batch(batch: dict, pad_id: int, max_prompt_tokens: Optional[int] = None,
                       context: Optional[int] = None, max_new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout prompts from a training batch: each row up to and including the token before its first loss token
    (i.e. the conversation up to the first assistant reply, header included). A row without loss tokens (a
    prompt-only row) is its prompt in full. Longer prompts keep their LAST max_prompt_tokens tokens (and leave
    max_new_tokens of room under the target's context). Returns left-padded (B, T) ids and mask."""
    ids, am, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    if bool((am.sum(1) == 0).any()):
        raise ValueError("a batch row has no tokens: rollouts need at least one prompt token per row")
    real_len = am.long().sum(1)                                              # (B,) right-padded rows
    has_loss = lm.any(1)
    length = torch.where(has_loss, lm.long().argmax(1) + 1, real_len)     # (B,) prompt tokens
    limit = max_prompt_tokens
    if context is not None:
        room = context - max_new_tokens
        if room < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's context "
                             f"of {context} tokens")
        limit = room if limit is None else min(limit, room)
    start = (length - limit).clamp(min=0) if limit is not None else torch.zeros_like(length)
    plen = length - start                                                    # (B,)
    T = int(plen.max())
    col = torch.arange(T, device=ids.device)
    pad = (T - plen)[:, None]                                                # (B, 1) left padding
    src = (start[:, None] + col - pad).clamp(0, ids.shape[1] - 1)           # (B, T)
    mask = col >= pad                                                        # (B, T)
    out = torch.where(mask, ids.gather(1, src), torch.full_like(src, pad_id))
    return out, mask.long()


# ----------------------------------------------------------------------------------------------- draft only
def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R rows -> ids (R, L) left-padded, mask (R, L), position ids (R, L)."""
    ids, mask = pad_rows(rows, pad_id, side="left")
    return ids, mask, position_ids(mask)


@torch.no_grad()
def _full_logits(model, rows: list[torch.Tensor], pad_id: int) -> list[torch.Tensor]:
    """Each row's logits (L_r, V) from one batched forward."""
    ids, mask, pos = left_pad(rows, pad_id)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits   # (R, L, V)
    L = ids.shape[1]
    return [logits[k, L - len(r):] for k, r in enumerate(rows)]


def _free_rollout(target_model, draft_model, prompt_ids, prompt_mask, *, gamma, max_new_tokens, temperature,
                  draft_policy, eos, generator, pad_id, top_k) -> DraftedPositions:
    """assist=False: the draft decodes alone (greedily under the greedy drafting policy); the target scores afterwards;
    blocks of gamma are verified as rounds would be (greedy, or rejection sampling with q or one-hot q: the evaluator's
    code) to tag and weight the positions."""
    device = prompt_ids.device
    q_temperature = draft_temperature(draft_policy, temperature)
    free = target_generate(draft_model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                           temperature=q_temperature, eos_token_id=eos, generator=generator)
    B = prompt_ids.shape[0]
    trajs = trajectories(prompt_ids, prompt_mask, free.sequences.to(device), free.num_new_tokens.to(device))
    plen = prompt_mask.long().sum(1).tolist()
    t_logits = _full_logits(target_model, trajs, pad_id)                   # B x (L_b, V)
    d_logits = _full_logits(draft_model, trajs, pad_id) if q_temperature > 0 else None
    stats = RolloutStats(rows=B, new_tokens=int(free.num_new_tokens.sum()),
                         target_tokens=sum(len(t) for t in trajs))
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("row", "ctx", "tok", "cat", "acc", "rid", "idx", "alpha")}
    targets, rid = [], 0
    for b in range(B):
        n_new, p0 = int(free.num_new_tokens[b]), plen[b]
        for s in range(0, n_new, gamma):
            K = min(gamma, n_new - s)
            ctx = p0 + s + torch.arange(K, device=device)                     # (K,) context lengths
            drafts = trajs[b][ctx][None]                                      # (1, K) drafted = generated tokens
            tl = t_logits[b][ctx[0] - 1: ctx[-1] + 1][None]                  # (1, K+1, V) at [pending, d_1..d_K]
            if temperature == 0:
                verdict = verify(Proposal(drafts), tl)
            else:
                p = probs_from_logits(tl, temperature)
                q = None if d_logits is None else probs_from_logits(d_logits[b][ctx - 1][None], temperature)
                verdict = verify(Proposal(drafts, q), tl, p, generator)  # q None: one-hot at the (greedy) drafts
            n = int(verdict.num_accepted)
            i = torch.arange(K, device=device)
            parts["row"].append(torch.full((K,), b, device=device))
            parts["ctx"].append(ctx)
            parts["tok"].append(drafts[0])
            parts["cat"].append(torch.where(i < n, ACCEPTED, torch.where(i == n, FIRST_REJECTED, AFTER_REJECTION)))
            parts["acc"].append(verdict.accepted[0])
            parts["rid"].append(torch.full((K,), rid, device=device))
            parts["idx"].append(i)
            parts["alpha"].append(verdict.alpha[0].float())
            targets.append(TargetLogits.from_logits(tl[0, :K], top_k))
            stats.target_forwards += 1
            stats.drafted += min(n + 1, K)
            stats.accepted += n
            stats.emitted += n + 1
            stats.alpha += float(verdict.alpha[0, : n + 1].sum())
            rid += 1
    out = assemble_positions(trajs, parts, targets, stats)
    out.source = list(range(B))
    return out


# ----------------------------------------------------------------------------------------------- entry
@torch.no_grad()
def collect_rollout(target_model, draft_model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                    gamma: int, max_new_tokens: int, temperature: float = 1.0,
                    draft_policy: str = DEFAULT_DRAFT_POLICY, assist: bool = True,
                    eos_token_id=None, generator: Optional[torch.Generator] = None, pad_id: int = 0,
                    top_k: int = 0, branches: bool = True, cache: Optional[CacheMode] = None,
                    tree: Optional[TreeShape] = None) -> DraftedPositions:
    """Roll out the draft on left-padded prompts (B, T) and return every drafted position.

    target_model / draft_model: HF causal LMs (unwrapped, eval mode). assist=True runs real speculative decoding
    (the evaluator's decoder); assist=False lets the draft decode alone (ablation). branches=False drops the
    positions after a rejection (their context is off the final trajectory). draft_policy: how drafts are proposed at
    temperature > 0 (decoding.DRAFT_POLICIES; greedy = argmax drafts verified one-hot, as the engines serve).
    Drafts that read target features per row (EAGLE-3) get them from the verify forwards (no second target pass).
    cache: the KV caches of the speculative decoding (decoding.CacheMode: static or compiled; None: growing).
    tree: decode token trees of this shape instead of chains of gamma (decoding.speculative_generate's strategy;
    draft_policy greedy, assist only); the positions are the trees' contexts, with parent and edge for reach weights
    (onpolicy/positions.py).
    """
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1 for on-policy rollouts, got {gamma}")
    draft = draft_adapter(draft_model)
    draft.check_target(target_model, "on-policy distillation compares the two distributions token by token; use a "
                       "draft with the target's tokenizer and output size")
    limit = draft.max_positions()
    if limit is not None and int(prompt_mask.sum(1).max()) + max_new_tokens > limit:
        raise ValueError(f"prompt + max_new_tokens exceeds the draft's max_position_embeddings={limit}: lower "
                         "objective.max_new_tokens or objective.max_prompt_tokens")
    if tree is not None and not assist:
        raise ValueError("token-tree rollouts (objective.tree_topk > 0) are verified by the target: keep "
                         "objective.assist=true, or set objective.tree_topk=0 for the draft-only ablation")
    if not assist:
        if not draft.decodes_alone:
            raise ValueError(f"objective.assist=false is not available for {draft.kind} drafts: they cannot decode "
                             "alone (every token they condition on needs the target's hidden states)")
        return _free_rollout(target_model, draft_model, prompt_ids, prompt_mask, gamma=gamma,
                             max_new_tokens=max_new_tokens, temperature=temperature, draft_policy=draft_policy,
                             eos=eos_token_id,
                             generator=generator, pad_id=pad_id, top_k=top_k)
    draft.check_prompts(prompt_mask)
    layers = draft.row_feature_layers()  # EAGLE-3: the aux layers, kept from the verify forwards as they decode
    common = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos_token_id,
                  generator=generator, record=True, draft_policy=draft_policy, capture_layers=layers,
                  cache=cache or CacheMode())
    # Rows that stopped leave the batch (growing caches): on a forward whose cost grows with its rows, the rollout's
    # longest row no longer makes every row pay for its rounds.
    rollout = speculative_generate(target_model, draft.drafter(), prompt_ids, prompt_mask,
                                   strategy=gamma if tree is None else tree, drop_finished_rows=True, **common)
    positions = positions_from_rounds(prompt_ids, prompt_mask, rollout, top_k, branches)
    positions.stats.output_buckets = output_position_buckets(rollout.rounds)  # the evaluator's buckets
    if layers:
        positions.aux = trajectory_features(rollout.hidden, prompt_mask, max(len(r) for r in positions.rows))
    return positions
