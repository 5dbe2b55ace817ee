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

from dataclasses import dataclass, field
from typing import Optional

import torch

from specdistill.decoding import (LMDrafter, probs_from_logits, speculative_generate, target_generate, verify_greedy,
                              verify_sampling)
from specdistill.decoding.kv import logits_dim, max_positions

ACCEPTED, FIRST_REJECTED, AFTER_REJECTION = 0, 1, 2
CATEGORIES = ("accepted", "first_rejected", "after_rejection")


# ----------------------------------------------------------------------------------------------- containers
@dataclass
class TargetLogits:
    """The target's distribution at P positions: full raw logits (P, V), or its top-k (values, ids (P, k))."""

    values: torch.Tensor                   # (P, V) or (P, k)
    indices: Optional[torch.Tensor] = None  # (P, k) long, None = full
    vocab: int = 0

    @classmethod
    def from_logits(cls, logits: torch.Tensor, top_k: int = 0) -> "TargetLogits":
        V = logits.shape[-1]
        if top_k and top_k < V:
            values, indices = logits.float().topk(top_k, dim=-1)
            return cls(values, indices, V)
        return cls(logits.float(), None, V)

    def __len__(self) -> int:
        return self.values.shape[0]

    def select(self, idx: torch.Tensor) -> "TargetLogits":
        return TargetLogits(self.values[idx], None if self.indices is None else self.indices[idx], self.vocab)

    def to(self, device) -> "TargetLogits":
        return TargetLogits(self.values.to(device), None if self.indices is None else self.indices.to(device),
                            self.vocab)

    def dense(self) -> torch.Tensor:
        """(P, V) logits. Top-k: the tail sits 20 nats under the k-th logit (~e^-20 each, finite so that reverse KL
        and JSD stay finite): p is the top-k renormalised, to within V * e^-20."""
        if self.indices is None:
            return self.values
        floor = self.values.min(-1, keepdim=True).values - 20.0            # (P, 1)
        out = floor.expand(-1, self.vocab).clone()
        return out.scatter_(1, self.indices, self.values)

    @staticmethod
    def cat(parts: list["TargetLogits"]) -> "TargetLogits":
        if any((p.indices is None) != (parts[0].indices is None) for p in parts):
            raise ValueError("cannot mix full and top-k target logits")
        idx = None if parts[0].indices is None else torch.cat([p.indices for p in parts])
        return TargetLogits(torch.cat([p.values for p in parts]), idx, parts[0].vocab)


@dataclass
class RolloutStats:
    """Sums over one rollout batch (ratios are taken from sums)."""

    rows: int = 0
    new_tokens: int = 0          # tokens generated
    target_forwards: int = 0     # row-rounds (assist) or simulated blocks (no assist)
    emitted: int = 0             # tokens those rounds emit (accepted drafts + the correction or bonus): tau = emitted
    #                              / target_forwards; = new_tokens with assist, what speculation would emit without
    drafted: int = 0             # drafted positions verified
    accepted: int = 0            # of them accepted by the verifier
    alpha: float = 0.0           # sum of sum_x min(p, q) over drafted positions (rollout temperature)
    target_tokens: int = 0       # tokens the target ran a forward over (prefill + verification, real rows only)


@dataclass
class DraftedPositions:
    """P drafted positions with their contexts in R token rows (1-D, unpadded)."""

    rows: list[torch.Tensor]     # R x (L_r,) long
    row: torch.Tensor            # (P,) which row holds the context
    context_len: torch.Tensor    # (P,) the context is rows[row][:context_len]; the draft predicts the next token
    token: torch.Tensor          # (P,) the drafted token
    target: TargetLogits         # (P, V) the target's raw logits at the position
    category: torch.Tensor       # (P,) ACCEPTED | FIRST_REJECTED | AFTER_REJECTION
    accepted: torch.Tensor       # (P,) bool, the verifier's decision (== category ACCEPTED)
    round_id: torch.Tensor       # (P,) one id per (round, row); positions of a round are contiguous, by index
    index: torch.Tensor          # (P,) 0-based draft position within the round
    alpha: torch.Tensor          # (P,) sum_x min(p, q) at the rollout's temperature (0/1 at temperature 0)
    stats: RolloutStats = field(default_factory=RolloutStats)
    source: Optional[list[int]] = None   # R: the trajectory each row comes from (a branch: its round's row)
    aux: Optional[torch.Tensor] = None   # EAGLE-3 heads: (R, L, n_aux * Ht) the target's aux hidden states per row

    def __len__(self) -> int:
        return self.row.shape[0]

    def contexts(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The context token rows of positions idx (each (context_len,))."""
        return [self.rows[int(r)][: int(n)] for r, n in zip(self.row[idx].tolist(), self.context_len[idx].tolist())]


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


def _trajectories(prompt_ids, prompt_mask, sequences, num_new) -> list[torch.Tensor]:
    return [torch.cat([prompt_ids[b][prompt_mask[b].bool()], sequences[b, : int(num_new[b])]])
            for b in range(prompt_ids.shape[0])]


# ----------------------------------------------------------------------------------------------- assisted
def positions_from_rounds(prompt_ids, prompt_mask, rollout, top_k: int, branches: bool) -> DraftedPositions:
    """Turn the RoundRecords of a recorded speculative rollout into drafted positions."""
    B = prompt_ids.shape[0]
    device = prompt_ids.device
    trajs = _trajectories(prompt_ids, prompt_mask, rollout.sequences.to(device), rollout.num_new_tokens.to(device))
    rows, source = list(trajs), list(range(B))
    plen = prompt_mask.long().sum(1)                                         # (B,)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("row", "ctx", "tok", "cat", "acc", "rid", "idx", "alpha")}
    targets: list[TargetLogits] = []
    n_new = int(rollout.num_new_tokens.sum())
    stats = RolloutStats(rows=B, new_tokens=n_new, emitted=n_new, target_forwards=int(rollout.target_forwards.sum()),
                         target_tokens=int((plen - 1).sum()))                # the prefill feeds prompt[:-1]
    rid = 0
    for rnd in rollout.rounds:
        K = rnd.gamma
        active = rnd.active.to(device)
        stats.target_tokens += int(active.sum()) * (K + 1)
        if K == 0:
            continue
        n, count = rnd.num_accepted.to(device), rnd.num_emitted.to(device)   # (B,)
        i = torch.arange(K, device=device).expand(B, K)                      # (B, K)
        category = torch.where(i < n[:, None], ACCEPTED, torch.where(i == n[:, None], FIRST_REJECTED, AFTER_REJECTION))
        # On the trajectory: contexts within what the round emitted (drafts past an EOS inside the accepted run are
        # dropped). After a rejection: kept when the whole accepted run + correction was emitted.
        on_traj = i < count[:, None]
        off_traj = (i > n[:, None]) & (count == n + 1)[:, None]
        keep = active[:, None] & (on_traj | (off_traj & branches))          # (B, K)
        stats.drafted += int((active[:, None] & (i <= n[:, None])).sum())   # what the verifier decided on
        stats.accepted += int((rnd.accepted.to(device) & active[:, None]).sum())
        stats.alpha += float((rnd.alpha.to(device) * (active[:, None] & (i <= n[:, None]))).sum())
        base = plen + rnd.offset.to(device)                                  # (B,) context length at draft 0
        row = torch.arange(B, device=device)[:, None].expand(B, K).clone()  # (B, K)
        drafts = rnd.draft_tokens.to(device)
        for b in (keep & off_traj).any(1).nonzero().flatten().tolist():     # one branch row per such round
            nb, start = int(n[b]), int(base[b])
            row[b, nb + 1:] = len(rows)
            rows.append(torch.cat([trajs[b][: start + nb], drafts[b, nb: K - 1]]))
            source.append(b)
        sel = keep.nonzero(as_tuple=True)                                    # row-major: rounds contiguous, by index
        parts["row"].append(row[sel])
        parts["ctx"].append((base[:, None] + i)[sel])
        parts["tok"].append(drafts[sel])
        parts["cat"].append(category[sel])
        parts["acc"].append(rnd.accepted.to(device)[sel])
        parts["rid"].append((rid + torch.arange(B, device=device)[:, None].expand(B, K))[sel])
        parts["idx"].append(i[sel])
        parts["alpha"].append(rnd.alpha.to(device).float()[sel])
        targets.append(TargetLogits.from_logits(rnd.target_logits[:, :K].to(device)[sel], top_k))
        rid += B
    out = _assemble(rows, parts, targets, stats)
    out.source = source
    return out


def _assemble(rows, parts, targets, stats) -> DraftedPositions:
    device = rows[0].device
    if not targets:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return DraftedPositions(rows, empty, empty, empty, TargetLogits(torch.zeros(0, 1, device=device)), empty,
                                empty.bool(), empty, empty, empty.float(), stats)
    cat = {k: torch.cat(v) for k, v in parts.items()}
    # round ids renumbered 0.. in order of appearance
    _, rid = torch.unique_consecutive(cat["rid"], return_inverse=True)
    return DraftedPositions(rows, cat["row"], cat["ctx"], cat["tok"], TargetLogits.cat(targets), cat["cat"],
                            cat["acc"].bool(), rid, cat["idx"], cat["alpha"], stats)


# ----------------------------------------------------------------------------------------------- draft only
def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R rows -> ids (R, L) left-padded, mask (R, L), position ids (R, L)."""
    L = max(len(r) for r in rows)
    device = rows[0].device
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), L, dtype=torch.long, device=device)
    for k, r in enumerate(rows):
        ids[k, L - len(r):] = r
        mask[k, L - len(r):] = 1
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


@torch.no_grad()
def _full_logits(model, rows: list[torch.Tensor], pad_id: int) -> list[torch.Tensor]:
    """Each row's logits (L_r, V) from one batched forward."""
    ids, mask, pos = left_pad(rows, pad_id)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits   # (R, L, V)
    L = ids.shape[1]
    return [logits[k, L - len(r):] for k, r in enumerate(rows)]


def _free_rollout(target_model, draft_model, prompt_ids, prompt_mask, *, gamma, max_new_tokens, temperature, eos,
                  generator, pad_id, top_k) -> DraftedPositions:
    """assist=False: the draft decodes alone; the target scores afterwards; blocks of gamma are verified as rounds
    would be (greedy or rejection sampling, same code as the evaluator) to tag and weight the positions."""
    device = prompt_ids.device
    free = target_generate(draft_model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                           temperature=temperature, eos_token_id=eos, generator=generator)
    B = prompt_ids.shape[0]
    trajs = _trajectories(prompt_ids, prompt_mask, free.sequences.to(device), free.num_new_tokens.to(device))
    plen = prompt_mask.long().sum(1).tolist()
    t_logits = _full_logits(target_model, trajs, pad_id)                   # B x (L_b, V)
    d_logits = _full_logits(draft_model, trajs, pad_id) if temperature > 0 else None
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
                verdict = verify_greedy(drafts, tl)
            else:
                p = probs_from_logits(tl, temperature)
                q = probs_from_logits(d_logits[b][ctx - 1][None], temperature)
                verdict = verify_sampling(drafts, q, p, generator)
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
    out = _assemble(trajs, parts, targets, stats)
    out.source = list(range(B))
    return out


# ----------------------------------------------------------------------------------------------- entry
@torch.no_grad()
def collect_rollout(target_model, draft_model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                    gamma: int, max_new_tokens: int, temperature: float = 1.0, assist: bool = True,
                    eos_token_id=None, generator: Optional[torch.Generator] = None, pad_id: int = 0,
                    top_k: int = 0, branches: bool = True) -> DraftedPositions:
    """Roll out the draft on left-padded prompts (B, T) and return every drafted position.

    target_model / draft_model: HF causal LMs (unwrapped, eval mode). assist=True runs real speculative decoding
    (the evaluator's decoder); assist=False lets the draft decode alone (ablation). branches=False drops the
    positions after a rejection (their context is off the final trajectory).
    """
    from specdistill.models.eagle3 import is_eagle3

    if gamma < 1:
        raise ValueError(f"gamma must be >= 1 for on-policy rollouts, got {gamma}")
    eagle3 = is_eagle3(draft_model)
    V = logits_dim(target_model)
    Vd = draft_model.config.vocab_size if eagle3 else logits_dim(draft_model)  # EAGLE-3: q is over the target's V
    if V != Vd:
        raise ValueError(f"draft vocab size {Vd} != target vocab size {V}: on-policy distillation compares the two "
                         "distributions token by token; use a draft with the target's tokenizer and output size")
    limit = draft_model.config.max_position_embeddings if eagle3 else max_positions(draft_model)
    if limit is not None and int(prompt_mask.sum(1).max()) + max_new_tokens > limit:
        raise ValueError(f"prompt + max_new_tokens exceeds the draft's max_position_embeddings={limit}: lower "
                         "objective.max_new_tokens or objective.max_prompt_tokens")
    if eagle3:
        from specdistill.onpolicy.eagle3 import eagle3_rollout

        if not assist:
            raise ValueError("objective.assist=false is not available for EAGLE-3 heads: a head cannot decode alone "
                             "(every token it conditions on needs the target's hidden states)")
        return eagle3_rollout(target_model, draft_model, prompt_ids, prompt_mask, gamma=gamma,
                              max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos_token_id,
                              generator=generator, pad_id=pad_id, top_k=top_k, branches=branches)
    if not assist:
        return _free_rollout(target_model, draft_model, prompt_ids, prompt_mask, gamma=gamma,
                             max_new_tokens=max_new_tokens, temperature=temperature, eos=eos_token_id,
                             generator=generator, pad_id=pad_id, top_k=top_k)
    rollout = speculative_generate(target_model, LMDrafter(draft_model), prompt_ids, prompt_mask, gamma=gamma,
                                   max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos_token_id,
                                   generator=generator, record=True)
    return positions_from_rounds(prompt_ids, prompt_mask, rollout, top_k, branches)


# ----------------------------------------------------------------------------------------------- loss forward
def draft_logits_at(model, rows: list[torch.Tensor], row: torch.Tensor, context_len: torch.Tensor,
                    pad_id: int) -> torch.Tensor:
    """(P, V) the draft's next-token logits after rows[row[p]][:context_len[p]], WITH grad, from ONE forward of the
    model's own __call__ (so a DDP/FSDP wrapper syncs gradients). Rows are left-padded (explicit position ids) so
    that each ends in the last column; the head runs only on the union of the needed columns (logits_to_keep),
    about max_new_tokens of them for rollout rows."""
    ids, mask, pos = left_pad(rows, pad_id)
    L = ids.shape[1]
    lengths = torch.tensor([len(r) for r in rows], device=ids.device)
    col = L - lengths[row] + context_len - 1                                  # (P,) column of each position's logits
    keep, where = torch.unique(col, sorted=True, return_inverse=True)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep, use_cache=False)
    return out.logits[row, where]                                              # (P, V)
