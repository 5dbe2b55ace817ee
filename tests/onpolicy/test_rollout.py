"""Rollout bookkeeping: same decisions as the evaluator's decoder, exact contexts (branches included), prompts."""
import pytest
import torch

from specdistill.drafts.lm import draft_logits_at
from specdistill.onpolicy.rollout import (ACCEPTED, AFTER_REJECTION, FIRST_REJECTED, TargetLogits, collect_rollout,
                                          prompts_from_batch)
from specdistill.decoding import LMDrafter, Proposal, speculative_generate, target_generate, verify

GAMMA, NEW = 3, 12


def _collect(pair, ids, mask, temperature, seed=0, **kw):
    target, draft = pair
    g = torch.Generator().manual_seed(seed) if temperature > 0 else None
    return collect_rollout(target, draft, ids, mask, gamma=GAMMA, max_new_tokens=NEW, temperature=temperature,
                           generator=g, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bookkeeping_agrees_with_the_evaluators_decisions(pair, ragged_prompts, temperature):
    target, draft = pair
    ids, mask = ragged_prompts
    g = torch.Generator().manual_seed(0) if temperature > 0 else None
    # What the evaluator runs (record=False), on the same seed, as rollouts run it (stopped rows leave the batch).
    ref = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=GAMMA, max_new_tokens=NEW,
                               temperature=temperature, generator=g, drop_finished_rows=True)
    pos = _collect(pair, ids, mask, temperature)
    for b in range(3):
        assert pos.rows[b].tolist() == ids[b][mask[b].bool()].tolist() + ref.tokens(b)
    s = pos.stats
    assert s.accepted == int(ref.position_accepted.sum()) == int(pos.accepted.sum())
    assert s.new_tokens == s.emitted == int(ref.num_new_tokens.sum())
    assert s.target_forwards == int(ref.target_forwards.sum())
    # Per (round, row): ACCEPTED positions = the verifier's num_accepted, in index order, then one FIRST_REJECTED
    # (unless all were accepted), then AFTER_REJECTION.
    expected = [(int(rnd.num_accepted[b]), rnd.gamma) for rnd in ref.rounds for b in range(3)
                if rnd.active[b] and rnd.gamma > 0]
    got = []
    for r in range(int(pos.round_id.max()) + 1):
        sel = pos.round_id == r
        cats, idx = pos.category[sel].tolist(), pos.index[sel].tolist()
        assert idx == list(range(len(idx)))
        n = cats.count(ACCEPTED)
        assert cats == [ACCEPTED] * n + [FIRST_REJECTED] * (n < len(cats)) + [AFTER_REJECTION] * (len(cats) - n - 1)
        got.append((n, len(cats)))
    assert got == expected  # no EOS here: every drafted position is kept
    assert torch.equal(pos.accepted, pos.category == ACCEPTED)
    assert bool((pos.category == AFTER_REJECTION).any()) and bool((pos.category == FIRST_REJECTED).any())


@torch.no_grad()
def test_contexts_are_the_ones_the_draft_and_target_saw(pair, ragged_prompts):
    """Greedy: every drafted token is the draft's argmax after its recorded context (branches included), and the
    recorded target logits are the target's on that context; accepted tokens sit on the trajectory."""
    target, draft = pair
    ids, mask = ragged_prompts
    pos = _collect(pair, ids, mask, 0.0)
    for p, ctx in enumerate(pos.contexts(torch.arange(len(pos)))):
        q = draft(ctx[None]).logits[0, -1]
        assert int(q.argmax()) == int(pos.token[p])
        assert torch.allclose(target(ctx[None]).logits[0, -1], pos.target.values[p], atol=1e-4)
        traj = pos.rows[int(pos.row[p])] if pos.category[p] != AFTER_REJECTION else None
        if pos.category[p] == ACCEPTED:
            assert int(pos.row[p]) < 3 and traj[len(ctx)] == pos.token[p]
        if pos.category[p] == FIRST_REJECTED:  # the correction (target argmax) replaced the draft on the trajectory
            assert int(pos.row[p]) < 3 and traj[len(ctx)] != pos.token[p]
        if pos.category[p] == AFTER_REJECTION:  # off the trajectory: a branch row holding the rejected draft
            assert int(pos.row[p]) >= 3
    # the packed, left-padded, with-grad forward gives the same logits as one context at a time
    packed = draft_logits_at(draft, pos.rows, pos.row, pos.context_len, pad_id=0)
    single = torch.stack([draft(c[None]).logits[0, -1] for c in pos.contexts(torch.arange(len(pos)))])
    assert torch.allclose(packed, single, atol=1e-4)
    # dropping branches keeps exactly the on-trajectory positions
    nob = _collect(pair, ids, mask, 0.0, branches=False)
    assert len(nob.rows) == 3 and len(nob) == int((pos.category != AFTER_REJECTION).sum())


def test_eos_inside_accepted_drafts_drops_what_follows(pair, ragged_prompts):
    target, draft = pair
    ids, mask = ragged_prompts
    free = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=GAMMA, max_new_tokens=NEW)
    eos = int(free.sequences[0, 4])
    pos = _collect(pair, ids, mask, 0.0, eos_token_id=eos)
    for p in range(len(pos)):
        if int(pos.row[p]) < 3:  # no on-trajectory context runs past an emitted EOS
            ctx = pos.rows[int(pos.row[p])][: int(pos.context_len[p])]
            plen = int(mask[int(pos.row[p])].sum())
            assert eos not in ctx[plen:].tolist()


@torch.no_grad()
def test_draft_only_rollout_is_the_drafts_own_decoding(pair, ragged_prompts):
    target, draft = pair
    ids, mask = ragged_prompts
    pos = _collect(pair, ids, mask, 0.0, assist=False)
    own = target_generate(draft, ids, mask, max_new_tokens=NEW)
    for b in range(3):
        assert pos.rows[b].tolist() == ids[b][mask[b].bool()].tolist() + own.tokens(b)
    assert len(pos.rows) == 3  # never a branch: the trajectory is the draft's own
    # blocks of gamma are tagged by the evaluator's greedy verifier
    for r in range(int(pos.round_id.max()) + 1):
        sel = (pos.round_id == r).nonzero().flatten()
        ctx = pos.contexts(sel[-1:])[0]
        full = torch.cat([ctx, pos.token[sel[-1:]]])[None]
        logits = target(full).logits[:, len(ctx) - len(sel):]                 # (1, K+1, V)
        v = verify(Proposal(pos.token[sel][None]), logits)
        assert pos.accepted[sel].tolist() == v.accepted[0].tolist()
    assert pos.stats.target_tokens == sum(len(r) for r in pos.rows)
    # tau of the simulated rounds: accepted drafts + 1 per block, not the draft's own tokens per block
    assert pos.stats.emitted == int(pos.accepted.sum()) + pos.stats.target_forwards


def test_prompts_from_batch_cuts_before_the_first_loss_token():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]),
             "loss_mask": torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])}  # row 1: prompt only
    ids, mask = prompts_from_batch(batch, pad_id=0)
    assert ids.tolist() == [[0, 5, 6, 7], [1, 2, 3, 4]] and mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    ids, mask = prompts_from_batch(batch, pad_id=0, max_prompt_tokens=2)
    assert ids.tolist() == [[6, 7], [3, 4]]
    batch["attention_mask"][1] = 0
    with pytest.raises(ValueError, match="no tokens"):
        prompts_from_batch(batch, pad_id=0)


def test_bad_input_fails_early(pair, ragged_prompts):
    target, _ = pair
    ids, mask = ragged_prompts
    from tests.onpolicy.conftest import tiny_lm
    with pytest.raises(ValueError, match="vocab"):
        collect_rollout(target, tiny_lm(2, vocab=40), ids, mask, gamma=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="gamma"):
        collect_rollout(target, target, ids, mask, gamma=0, max_new_tokens=4)


def test_top_k_target_keeps_the_top_of_the_distribution():
    logits = torch.randn(5, 40)
    t = TargetLogits.from_logits(logits, top_k=8)
    dense = t.dense()
    p, p_k = logits.softmax(-1), dense.softmax(-1)
    top = logits.topk(8, -1).indices
    assert torch.allclose(p_k.gather(1, top), p.gather(1, top) / p.gather(1, top).sum(-1, keepdim=True), atol=1e-6)
    assert torch.isfinite(dense).all()
