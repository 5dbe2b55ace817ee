"""Eagle3Drafter: lossless in the loop, and at every round its draft steps are the head's TTT unroll on the context."""

import pytest
import torch

from specdistill.decoding import probs_from_logits, speculative_generate, target_generate
from specdistill.drafts.eagle3 import Eagle3Drafter
from specdistill.decoding.kv import BatchKV
from specdistill.decoding.sampling import Sampler
from specdistill.decoding.tree import TreeShape
from tests.conftest import left_padded_prompts, make_tiny_lm, noisy_eagle3_head

V = 48


def _target(vocab=V, sharpen=1.0):
    target = make_tiny_lm(vocab, layers=4, hidden=32, seed=0).eval()  # aux ids default to (1, 2, 3)
    target.lm_head.weight.data.mul_(sharpen)  # HF init gives near-uniform p; sharpen for peaked distributions
    return target


def _head(target, vd, seed=0):
    return noisy_eagle3_head(target, vd, seed).eval()


class Traced(Eagle3Drafter):
    """Keeps every round's draft-step logits (B, K, Vd) and the rounds after which the head's cache compacted."""

    def __init__(self, head):
        super().__init__(head)
        self.trace, self.compacted_after = [], []

    def propose(self, shape, sampler):
        proposal = super().propose(shape, sampler)
        self.trace.append(self.logits)
        return proposal

    def _compact(self, widest):
        self.compacted_after.append(len(self.trace) - 1)
        super()._compact(widest)


@torch.no_grad()
def _check_against_ttt(target, head, ids, mask, rollout, trace) -> torch.Tensor:
    """Each round's draft step j equals the TTT unroll's step j at the slot of the position before the round's
    pending token, wherever d_1..d_j are on the final sequence (accepted and emitted: a row's budget can cut them).
    Returns the comparisons made (rounds, depth j)."""
    steps = max(r.gamma for r in rollout.rounds)
    checked = torch.zeros(len(rollout.rounds), steps, dtype=torch.long)
    for b in range(len(ids)):
        seq = torch.tensor([ids[b][mask[b].bool()].tolist() + rollout.tokens(b)])  # (1, L)
        hs = target(seq, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[k] for k in head.config.aux_layer_ids], -1)            # (1, L, 3Ht)
        ttt = head(aux, seq, torch.ones_like(seq), steps=steps)                    # steps x (1, L, Vd)
        prompt_len = int(mask[b].sum())
        for i, (rnd, logits) in enumerate(zip(rollout.rounds, trace)):
            t = prompt_len - 2 + int(rnd.offset[b])  # the pending token sits at t + 1
            if not rnd.active[b] or t < 0:           # a one-token prompt has no target feature in round 0
                continue
            for j in range(min(int(rnd.num_emitted[b]), rnd.gamma)):  # emitted = accepted + 1, or cut
                torch.testing.assert_close(logits[b, j], ttt[j][0, t], atol=1e-4, rtol=1e-4)
                checked[i, j] += 1
    return checked


# ---------------------------------------------------------------------------------------------- greedy is lossless
GREEDY_PROMPTS = {"batch1": [9], "batch3-left-padded": [9, 4, 1]}


@pytest.fixture(scope="module")
def fitted():
    """The target and a head fitted (hard CE, 3-step TTT unroll via head.forward) to the target's greedy
    continuations of the test prompts: trained with the training semantics, its drafts get accepted at inference."""
    target = _target()
    head = _head(target, vd=V)
    seqs = []
    for lengths in GREEDY_PROMPTS.values():
        ids, mask = left_padded_prompts(lengths)
        ref = target_generate(target, ids, mask, max_new_tokens=12)
        seqs += [ids[b][mask[b].bool()].tolist() + ref.tokens(b) for b in range(len(ids))]
    T = max(map(len, seqs))
    x = torch.tensor([s + [0] * (T - len(s)) for s in seqs])             # (N, T) right-padded
    am = (torch.arange(T) < torch.tensor([len(s) for s in seqs])[:, None]).long()
    with torch.no_grad():
        hs = target(x, attention_mask=am, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[k] for k in head.config.aux_layer_ids], -1)      # (N, T, 3Ht)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(40):
        loss = 0.0
        for j, logits in enumerate(head(aux, x, am, steps=3)):           # slot t at step j predicts token t+2+j
            m = am[:, 2 + j:] > 0                                         # token t+2+j is real
            loss = loss + torch.nn.functional.cross_entropy(logits[:, : T - 2 - j][m], x[:, 2 + j:][m])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, head.eval()


@torch.no_grad()
@pytest.mark.parametrize("lengths", GREEDY_PROMPTS.values(), ids=GREEDY_PROMPTS.keys())
def test_greedy_is_token_identical_and_drafts_are_the_ttt_unroll(lengths, fitted):
    target, head = fitted
    ids, mask = left_padded_prompts(lengths)
    reference = target_generate(target, ids, mask, max_new_tokens=12)
    deep = 0
    for gamma in range(1, 6):
        drafter = Traced(head)
        r = speculative_generate(target, drafter, ids, mask, strategy=gamma, max_new_tokens=12)
        assert torch.equal(r.sequences, reference.sequences), f"gamma={gamma} B={len(ids)}"
        checked = _check_against_ttt(target, head, ids, mask, r, drafter.trace)  # (rounds, gamma)
        # step 0 checked in every round of every row (the one-token row skips its first round)
        assert checked[:, 0].sum() == sum(int(rnd.active.sum()) for rnd in r.rounds if rnd.gamma > 0) - (1 in lengths)
        deep += int(checked[:, 1:].sum())
        if gamma > 1:  # the fitted head's drafts are accepted: rounds keep several tokens
            assert int(r.accept_hist[2:].sum()) > 0, r.accept_hist
    assert deep >= 10


# ---------------------------------------------------------------------------------------------- deeper steps
@torch.no_grad()
@pytest.mark.parametrize("vd", [V, 30])
def test_deeper_steps_equal_ttt_when_drafts_were_accepted(vd):
    # Near-uniform target and a softened head at temperature 1, drafts sampled from q: most drafts are accepted, rows
    # accept different counts in the same round (holes in the head's cache), and long runs compact the cache.
    target = _target()
    head = _head(target, vd=vd)
    head.lm_head.weight.data.mul_(0.3)
    ids, mask = left_padded_prompts([14, 5, 1, 9], seed=1)
    drafter = Traced(head)
    r = speculative_generate(target, drafter, ids, mask, strategy=5, max_new_tokens=120, temperature=1.0,
                             generator=torch.Generator().manual_seed(0), draft_policy="sample")
    checked = _check_against_ttt(target, head, ids, mask, r, drafter.trace)  # (rounds, 5)
    assert (checked.sum(0) >= 20).all(), checked.sum(0)  # every depth 0..4 compared often
    ragged = sum(len(set(rnd.num_accepted[rnd.active].tolist())) > 1 for rnd in r.rounds)
    assert ragged >= 5, ragged
    assert drafter.compacted_after and checked[drafter.compacted_after[0] + 1:, 1:].sum() >= 4  # exact after compacting


# ---------------------------------------------------------------------------------------------- sampling, reduced vocab
@torch.no_grad()
def test_sampling_keeps_the_target_distribution_with_a_reduced_vocab(chi_square_pvalue):
    Vt, N = 16, 6000
    target = _target(vocab=Vt, sharpen=10.0)
    head = _head(target, vd=10)
    prompt = torch.tensor([[3, 9, 4, 9, 4]])
    p1 = probs_from_logits(target(prompt).logits[0, -1], 1.0)               # (V,)
    both = torch.cat([prompt.expand(Vt, -1), torch.arange(Vt)[:, None]], 1)
    p2 = p1 @ probs_from_logits(target(both).logits[:, -1], 1.0)           # (V,) second-token marginal
    assert p1[~head.t2d].sum() > 0.05  # the target puts real mass where the draft cannot go
    r = speculative_generate(target, Eagle3Drafter(head), prompt.expand(N, -1), strategy=2, max_new_tokens=3,
                             temperature=1.0, generator=torch.Generator().manual_seed(0), record=True)
    for i, p in enumerate((p1, p2)):
        counts = torch.bincount(r.sequences[:, i], minlength=Vt)
        assert chi_square_pvalue(counts, p) > 1e-3, f"token {i}"
    assert 0.1 < r.acceptance_per_position[0] < 0.9  # both the accept and the resample paths were exercised
    for rnd in r.rounds:
        assert bool(head.t2d[rnd.draft_tokens].all())
    # q lives on the target vocabulary, zero outside the draft vocabulary: the drafter's own proposal after the prompt
    drafter, ones = Eagle3Drafter(head), torch.ones_like(prompt)
    prefill = BatchKV(target).prefill(prompt[:, :-1], ones[:, :-1], output_hidden_states=True)
    drafter.start(prompt, ones, target_hidden=prefill.hidden_states)
    q = drafter.propose(TreeShape.chain(2), Sampler(1.0, 1.0, torch.Generator().manual_seed(1))).probs    # (1, 2, Vt)
    assert q.shape == (1, 2, Vt) and bool((q[..., ~head.t2d] == 0).all())
    torch.testing.assert_close(q.sum(-1), torch.ones(1, 2))


@torch.no_grad()
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8)])
def test_a_reduced_vocab_never_proposes_outside_it(temperature, top_p):
    target = _target()
    head = _head(target, vd=12)
    ids, mask = left_padded_prompts([7, 3, 5], seed=2)
    drafter = Eagle3Drafter(head)
    r = speculative_generate(target, drafter, ids, mask, strategy=4, max_new_tokens=16, temperature=temperature,
                             top_p=top_p, generator=torch.Generator().manual_seed(0))
    for rnd in r.rounds:
        assert bool(head.t2d[rnd.draft_tokens].all())
    # the proposal is the head's draft-vocab argmax / sample mapped through d2t
    drafter.start(ids, mask, target(ids[:, :-1], attention_mask=mask[:, :-1], output_hidden_states=True).hidden_states)
    proposal = drafter.propose(TreeShape.chain(3), Sampler(0.0))
    assert torch.equal(proposal.tokens, head.draft_to_target(drafter.logits.argmax(-1)))


def test_missing_hidden_states_raise_a_clear_error():
    head = _head(_target(), vd=V)
    ids, mask = left_padded_prompts([4, 2])
    with pytest.raises(ValueError, match="hidden states"):
        Eagle3Drafter(head).start(ids, mask, None)
    short = tuple(torch.zeros(2, 3, 32) for _ in range(2))  # a 1-layer target's hidden_states
    with pytest.raises(ValueError, match="aux_layer_ids"):
        Eagle3Drafter(head).start(ids, mask, short)


# ---------------------------------------------------------------------------------------------- dynamic draft length
@torch.no_grad()
def test_confidence_stops_eagle3_drafting_early_and_stays_lossless(fitted):
    """With a confidence threshold the head proposes a prefix of its unthresholded chain, stopping after the first
    step at which every row's draft is unsure; decoding stays token-identical and some rounds really end early."""
    target, head = fitted
    ids, mask = left_padded_prompts(GREEDY_PROMPTS["batch3-left-padded"])
    hidden = target(ids[:, :-1], attention_mask=mask[:, :-1], output_hidden_states=True).hidden_states
    full = Eagle3Drafter(head)
    full.start(ids, mask, hidden)
    chain = full.propose(TreeShape.chain(5), Sampler(0.0)).tokens                            # (B, 5)
    conf = full.logits.float().softmax(-1).max(-1).values                   # (B, 5) greedy draft's probability
    threshold = float(conf.max(0).values.median())
    expect = next((j + 1 for j in range(5) if bool((conf[:, j] < threshold).all())), 5)
    short = Eagle3Drafter(head, confidence=threshold)
    short.start(ids, mask, hidden)
    got = short.propose(TreeShape.chain(5), Sampler(0.0)).tokens
    assert got.shape[1] == expect < 5 and torch.equal(got, chain[:, :expect])

    reference = target_generate(target, ids, mask, max_new_tokens=12)
    r = speculative_generate(target, Eagle3Drafter(head, confidence=threshold), ids, mask, strategy=5,
                             max_new_tokens=12)
    assert torch.equal(r.sequences, reference.sequences)
    assert any(rnd.gamma < 5 for rnd in r.rounds)
    with pytest.raises(ValueError, match="confidence"):
        Eagle3Drafter(head, confidence=1.0)
