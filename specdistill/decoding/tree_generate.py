"""Speculative decoding with token trees (EAGLE-2; SpecInfer): each round the drafter grows a tree, the target scores
every node in ONE forward with tree attention, verification keeps the longest acceptable path plus one target token.

A round mirrors generate.speculative_generate's, with a tree where the chain was:
  1. draft    drafter.propose_tree(shape) -> Tree of N nodes under the pending token (the root)
  2. verify   the target is fed [root, node 1..N] at positions (committed length + depth), each node attending to
              its ancestors only (BatchKV tail_visible); greedy: the longest path of target argmaxes, sampling:
              recursive rejection over siblings (tree_verify.py), lossless at every temperature
  3. commit   both caches keep the accepted path (BatchKV.commit_path gathers its columns to the front of the tail;
              the rest of the tree is dropped), next_token becomes the pending token
Rollout counters are by depth: position_proposed[d] counts row-rounds whose tree reaches depth d+1,
position_accepted[d] those whose accepted path does (acceptance by depth). Each round is a TreeRound: a RoundRecord
whose draft_tokens hold the accepted path's drafts (then PAD) and gamma the tree's depth, plus the tree itself and the
accepted path; score_nodes=True adds node_prob, the target's probability of each node's token at its parent (the cost
model's tree search replays trees from it: eval/tree_search.py); record=True adds that and the target's logits at
every node the draft fed (on-policy training on the tree: onpolicy/tree_positions.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .drafters import Drafter
from .generate import (RoundRecord, Rollout, _cache_length, _check_inputs, _check_draft_vocab, _clock, _counters,
                       _emit_counts, _eos, _KeptFeatures, _pad_id)
from .kv import CacheMode, TokenBuffer, device_of
from .sampling import DEFAULT_DRAFT_POLICY, Sampler, check_draft_policy
from .tree import Tree, TreeShape
from .tree_verify import verify_tree_greedy, verify_tree_sampling
from .verify import PAD


@dataclass
class TreeRound(RoundRecord):
    """One tree round (a RoundRecord whose draft_tokens are the accepted path's drafts, gamma the tree's depth)."""

    tree: Tree | None = None              # the round's proposal: N nodes under the root (the pending token)
    path: torch.Tensor | None = None      # (B, D+1) long node ids from the root to the last accepted node, 0-padded
    # score_nodes=True or record=True only: (B, N) the target's probability of node i's token at its parent,
    # processed at the decoding temperature (greedy: 1.0 where it is the target's argmax there, else 0): verification
    # reaches a node with the product along its path (recursive rejection accepts a top-k child x with probability
    # p(x): tree_verify.py)
    node_prob: torch.Tensor | None = None
    # record=True only: the contexts the draft proposed children at, the root (0) and every node with a child in the
    # tree, in node order then padded with -1 (B, C); target_logits (inherited) holds the target's raw logits there
    # (B, C, V)
    contexts: torch.Tensor | None = None


def proposes_trees(drafter: Drafter) -> bool:
    """Whether the drafter scores alternatives and grows token trees (it overrides Drafter.propose_tree: LM drafts,
    EAGLE-3 heads and DFlash drafters do; n-gram lookup proposes one token per position)."""
    return type(drafter).propose_tree is not Drafter.propose_tree


def node_probs(tree: Tree, logits: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """(B, N) the target's probability of each node's token at its parent: logits (B, N+1, V) of [root, nodes];
    probs the processed distribution (B, N+1, V), or None for greedy decoding (then 1.0 at the argmax, else 0)."""
    parents, tokens = tree.parents.to(logits.device), tree.tokens.to(logits.device)
    if probs is None:
        return (logits.argmax(-1).gather(1, parents) == tokens).float()
    V = probs.shape[-1]
    return probs.flatten(1).gather(1, parents * V + tokens).float()


def tree_contexts(tree: Tree) -> torch.Tensor:
    """(B, C) long: the root (0) and every node with a child in the tree, in node order, padded with -1."""
    B, N = tree.tokens.shape
    has_child = torch.zeros(B, N + 1, dtype=torch.bool, device=tree.tokens.device)
    has_child.scatter_(1, tree.parents, True)
    has_child[:, 0] = True
    C = int(has_child.sum(1).max())
    order = torch.sort((~has_child).int(), dim=1, stable=True).indices[:, :C]          # context nodes first, in order
    return torch.where(has_child.gather(1, order), order, -1)


def _path_hidden(hidden_states, path: torch.Tensor):
    """The target's per-layer hidden states (B, N+1, H) of the tree -> those of the path's nodes (B, D+1, H)."""
    if hidden_states is None:
        return None
    idx = path[..., None]
    return tuple(h.gather(1, idx.expand(-1, -1, h.shape[-1])) for h in hidden_states)


@torch.no_grad()
def tree_generate(
    target_model: torch.nn.Module,
    drafter: Drafter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    tree: TreeShape,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    draft_policy: str = DEFAULT_DRAFT_POLICY,
    cache: CacheMode = CacheMode(),
    record: bool = False,
    capture_layers: list[int] | None = None,
    score_nodes: bool = False,
) -> Rollout:
    """Generate from target_model with token trees from `drafter`; lossless as speculative_generate is: greedy
    output equals target-only greedy, sampled output is distributed as the target's.

    record: each TreeRound also keeps the target's raw logits at the round's contexts and node_prob (on-policy
    training). score_nodes: each TreeRound keeps node_prob (the cost model's tree search).
    capture_layers: HF hidden_states ids whose features of every kept token come back in Rollout.hidden, as
    speculative_generate's (the verify forward's columns of the accepted path).

    draft_policy: trees draft each node's top-k children, deterministic given the context and verified as one-hot
    proposals, which is the "greedy" policy; "sample" is refused (sampling children and keeping the best would
    bias the verification)."""
    check_draft_policy(draft_policy)
    if draft_policy != "greedy":
        raise ValueError(f"draft_policy={draft_policy!r} with a token tree: trees propose each node's top-k children "
                         "(draft_policy='greedy'); sampled drafts are verified along chains only")
    sampler = Sampler(temperature, top_p, generator)
    device = device_of(target_model)
    input_ids, attention_mask = _check_inputs(target_model, input_ids, attention_mask, max_new_tokens, device)
    _check_draft_vocab(target_model, drafter)
    B = input_ids.shape[0]
    eos = _eos(eos_token_id, device)
    hidden = {"output_hidden_states": True} if drafter.needs_hidden_states or capture_layers else {}
    out = TokenBuffer(B, max_new_tokens, device, fill=_pad_id(eos_token_id))
    D = tree.max_depth
    stats = _counters(B, D, device)
    rounds: list[RoundRecord] = []
    round_seconds: list[float] = []

    # 1. Prefill both models with the prompt but its last token, which becomes the root of the first tree.
    t0 = _clock(device)
    new_kv = cache.factory(_cache_length(input_ids, max_new_tokens, tree.size + 1))
    target = new_kv(target_model)
    try:
        prefill = target.prefill(input_ids[:, :-1], attention_mask[:, :-1], **hidden)
        drafter.start(input_ids, attention_mask, target_hidden=getattr(prefill, "hidden_states", None), new_kv=new_kv)
        kept = (_KeptFeatures(capture_layers, prefill, B, input_ids.shape[1], max_new_tokens, device) if capture_layers
                else None)
        pending = input_ids[:, -1]                                              # (B,)
        active = torch.ones(B, dtype=torch.bool, device=device)
        max_remaining = max_new_tokens
        t_prev = t_start = _clock(device)

        while True:
            # 2. Draft a tree; it never reaches past the budget (the token after the deepest node comes free).
            shape = tree.at_most(max(min(D, max_remaining - 1), 1))
            proposal = drafter.propose_tree(shape)
            nodes = proposal.tokens.to(device)                                  # (B, N)

            # 3. Verify: one target forward over [root, node 1..N] with tree attention, positions by depth.
            depths = proposal.depths().to(device)                               # (B, N+1)
            out_t = target.step(torch.cat([pending[:, None], nodes], dim=1), positions=target.length[:, None] + depths,
                                tail_visible=proposal.ancestors().to(device), **hidden)
            logits = out_t.logits                                               # (B, N+1, V)
            probs = None if sampler.greedy else sampler.probs(logits)          # (B, N+1, V) processed
            verdict = (verify_tree_greedy(proposal, logits) if sampler.greedy
                       else verify_tree_sampling(proposal, probs, None, generator))
            n = verdict.num_accepted                                            # (B,)

            # 4. Emit the accepted path + next token, cut at EOS and at max_new_tokens.
            offset = out.length
            count, done = _emit_counts(verdict.tokens, verdict.num_emitted, offset, max_new_tokens, eos, active)
            out.append(verdict.tokens, count)
            path_hidden = _path_hidden(getattr(out_t, "hidden_states", None), verdict.path)  # (B, D+1, H) per layer
            if kept is not None:
                kept.add(SimpleNamespace(hidden_states=path_hidden), offset, count)
            going = active & ~done

            # 5. Commit: rows that go on keep [root, accepted path]; next_token becomes their pending token.
            target.commit_path(verdict.path, (n + 1) * going)
            drafter.commit_path(verdict.path, n, verdict.next_token, going, target_hidden=path_hidden)
            pending = torch.where(going, verdict.next_token, pending)

            # 6. Counters by depth, from sums over active rows.
            K = verdict.alpha.shape[1]                                          # this tree's depth
            reached = torch.arange(K, device=device) < proposal.depth.max(1).values[:, None]  # (B, K) depth d+1 reached
            accepted = verdict.accepted & active[:, None]                       # (B, K)
            stats["target_forwards"] += active.long()
            stats["accept_hist"].scatter_add_(0, n, active.long())
            stats["position_proposed"][:K] += (reached & active[:, None]).sum(0)
            stats["position_accepted"][:K] += accepted.sum(0)
            stats["position_alpha"][:K] += (verdict.alpha * active[:, None]).sum(0)
            contexts = tree_contexts(proposal).to(device) if record else None
            rounds.append(TreeRound(
                gamma=K, active=active, offset=offset, draft_tokens=torch.where(accepted, verdict.tokens[:, :K], PAD),
                accepted=accepted, num_accepted=n * active, next_token=verdict.next_token, num_emitted=count,
                alpha=verdict.alpha * active[:, None], tree=proposal, path=verdict.path,
                node_prob=node_probs(proposal, logits, probs) if record or score_nodes else None, contexts=contexts,
                target_logits=None if contexts is None else logits.gather(
                    1, contexts.clamp(min=0)[..., None].expand(-1, -1, logits.shape[-1]))))

            # Loop control in one host sync.
            remaining = torch.where(going, max_new_tokens - out.length, 0).max()
            n_going, max_remaining = torch.stack([going.sum(), remaining]).tolist()
            active = going
            t_now = time.perf_counter()
            round_seconds.append(t_now - t_prev)
            t_prev = t_now
            if n_going == 0:
                break

        return Rollout(sequences=out.tokens[:, :max_new_tokens], num_new_tokens=out.length, rounds=rounds,
                       prefill_seconds=t_start - t0, round_seconds=round_seconds,
                       hidden=None if kept is None else kept.result(), **stats)
    finally:  # the call's caches go back now, for the next call to reuse (BatchKV.close)
        target.close()
        drafter.close()
