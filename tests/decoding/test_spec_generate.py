"""speculative_generate: lossless (greedy token-identical, sampled distribution = target's), exact counters, clear
errors."""

import pytest
import torch

from specdistill.decoding import (DynamicGamma, FixedGamma, LMDrafter, NGramDrafter, probs_from_logits,
                              speculative_generate, target_generate)

MAX_NEW = 16


def _drafter(kind, tiny_lm, target):
    if kind == "random":      # an independent draft: mostly rejected
        return LMDrafter(tiny_lm(1))
    if kind == "self":        # the target drafting for itself: everything accepted
        return LMDrafter(target)
    return NGramDrafter(max_ngram=3)


def _prompt_sets(ragged_prompts):
    ids, mask = ragged_prompts
    single = [(ids[b:b + 1, 9 - n:], mask[b:b + 1, 9 - n:]) for b, n in ((0, 9), (2, 2))]  # batch 1, no padding
    return single + [(ids, mask)]                                                         # batch 4, left-padded


# ---------------------------------------------------------------------------------------------- greedy is lossless
@pytest.mark.parametrize("kind", ["random", "self", "ngram"])
def test_greedy_is_token_identical_to_target_only(kind, tiny_lm, ragged_prompts):
    target = tiny_lm(0)
    for ids, mask in _prompt_sets(ragged_prompts):
        reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
        for gamma in range(1, 9):
            r = speculative_generate(target, _drafter(kind, tiny_lm, target), ids, mask, strategy=gamma,
                                     max_new_tokens=MAX_NEW)
            assert torch.equal(r.sequences, reference.sequences), f"{kind} gamma={gamma} B={len(ids)}"
            assert r.num_new_tokens.tolist() == [MAX_NEW] * len(ids)
            if kind == "self":  # every round accepts all it drafted: gamma + 1 tokens per forward but the last
                for rnd in r.rounds:
                    assert torch.equal(rnd.num_accepted, torch.full_like(rnd.num_accepted, rnd.gamma) * rnd.active)
                assert all(rnd.gamma == gamma for rnd in r.rounds[:-1])
                assert r.target_forwards.tolist() == [-(-MAX_NEW // (gamma + 1))] * len(ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_confidence_stopped_drafts_stay_lossless(tiny_lm, ragged_prompts, temperature):
    """Variable-width rounds from the confidence stop (a rule on the draft's own probabilities, so verification stays
    exact): greedy output is the target's; at T=1 every row still gets its full budget."""
    target = tiny_lm(0)
    ids, mask = ragged_prompts
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    g = torch.Generator().manual_seed(0)
    r = speculative_generate(target, LMDrafter(tiny_lm(1), confidence=0.2), ids, mask, strategy=6,
                             max_new_tokens=MAX_NEW, temperature=temperature, generator=g)
    widths = {rnd.gamma for rnd in r.rounds}
    assert len(widths) > 1  # the stop really varied the width
    if temperature == 0:
        assert torch.equal(r.sequences, reference.sequences)
    for rnd in r.rounds:
        assert bool((rnd.num_accepted <= rnd.gamma).all())
    assert r.num_new_tokens.tolist() == [MAX_NEW] * len(ids)


def test_zero_width_rounds_are_plain_target_steps(tiny_lm):
    """A prompt of distinct tokens gives the n-gram drafter nothing to match at first: those rounds propose 0 drafts,
    cost one forward each and emit one token, and the output is still the target's."""
    target = tiny_lm(0)
    ids = torch.arange(1, 10)[None]
    mask = torch.ones_like(ids)
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    r = speculative_generate(target, NGramDrafter(max_ngram=3), ids, mask, strategy=4, max_new_tokens=MAX_NEW)
    assert torch.equal(r.sequences, reference.sequences)
    widths = [rnd.gamma for rnd in r.rounds]
    assert 0 in widths
    assert sum(rnd.num_emitted.sum().item() for rnd in r.rounds) == MAX_NEW
    assert r.target_forwards.item() == len(r.rounds)
    assert r.position_proposed[0].item() == sum(1 for w in widths if w > 0)


def test_target_generate_matches_hf_generate(tiny_lm, ragged_prompts):
    target = tiny_lm(0)
    ids, mask = ragged_prompts
    for eos in (None, 7):
        ours = target_generate(target, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
        hf = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=eos, pad_token_id=0)[:, ids.shape[1]:]
        for b in range(len(ids)):
            assert ours.tokens(b) == hf[b, : len(ours.tokens(b))].tolist()
            assert len(ours.tokens(b)) == MAX_NEW or ours.tokens(b)[-1] == eos


def test_eos_stops_each_row_identically(tiny_lm, ragged_prompts):
    target = tiny_lm(0)
    ids, mask = ragged_prompts
    free = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    eos = int(free.sequences[1, 3])  # a token row 1 produces early; other rows may or may not
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=[eos, 47])
    assert reference.num_new_tokens[1] == 4
    for kind in ("random", "self", "ngram"):
        r = speculative_generate(target, _drafter(kind, tiny_lm, target), ids, mask, strategy=5,
                                 max_new_tokens=MAX_NEW, eos_token_id=[eos, 47])
        assert torch.equal(r.num_new_tokens, reference.num_new_tokens)
        assert [r.tokens(b) for b in range(4)] == [reference.tokens(b) for b in range(4)]
        assert bool((r.sequences[1, 4:] == eos).all())  # padded with the (first) EOS id


def test_counters_are_consistent_with_round_records(tiny_lm, ragged_prompts):
    target = tiny_lm(0)
    ids, mask = ragged_prompts
    r = speculative_generate(target, LMDrafter(tiny_lm(1)), ids, mask, strategy=DynamicGamma(1, 6, 3),
                             max_new_tokens=MAX_NEW, eos_token_id=5, temperature=1.0,
                             generator=torch.Generator().manual_seed(0))
    active = torch.stack([rnd.active for rnd in r.rounds])                  # (R, B)
    assert torch.equal(r.target_forwards, active.long().sum(0))
    assert r.accept_hist.sum() == r.target_forwards.sum()
    assert torch.equal(r.num_new_tokens, sum(rnd.num_emitted for rnd in r.rounds))
    assert r.mean_accept_len == pytest.approx(r.num_new_tokens.sum().item() / r.target_forwards.sum().item())
    for k in range(6):
        assert r.position_proposed[k] == sum(int(rnd.active.sum()) for rnd in r.rounds if rnd.gamma > k)
        assert r.position_accepted[k] == sum(int(rnd.accepted[:, k].sum()) for rnd in r.rounds if rnd.gamma > k)
    assert len(r.round_seconds) == len(r.rounds) and r.prefill_seconds >= 0
    # The sequences are the rounds' accepted drafts + next tokens, placed at each round's offset.
    for b in range(4):
        rebuilt = []
        for rnd in r.rounds:
            if rnd.active[b]:
                assert rnd.offset[b] == len(rebuilt)
                n = int(rnd.num_accepted[b])
                rebuilt += (rnd.draft_tokens[b, :n].tolist() + [int(rnd.next_token[b])])[: int(rnd.num_emitted[b])]
        assert rebuilt == r.tokens(b)


@torch.no_grad()
def test_recorded_probs_align_with_the_sequence(tiny_lm, ragged_prompts):
    target = tiny_lm(0)
    ids, mask = ragged_prompts
    r = speculative_generate(target, LMDrafter(tiny_lm(1)), ids, mask, strategy=3, max_new_tokens=8,
                             temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(0), record=True)
    for b in range(4):
        prompt = ids[b][mask[b].bool()].tolist()
        full = torch.tensor([prompt + r.tokens(b)])
        fresh = probs_from_logits(target(full).logits[0], 0.8, 0.9)         # (T, V)
        for rnd in r.rounds:
            assert rnd.target_logits.shape == (4, rnd.gamma + 1, 48)
            p = probs_from_logits(rnd.target_logits[b, : rnd.gamma], 0.8, 0.9)   # (K, V), as the verifier saw it
            n = int(rnd.num_accepted[b])
            for k in range(min(n + 1, rnd.gamma)):  # accepted drafts and the first rejected one sit on the sequence
                pos = len(prompt) - 1 + int(rnd.offset[b]) + k
                if rnd.active[b] and pos < full.shape[1] - 1:
                    assert torch.allclose(p[k], fresh[pos], atol=1e-5)


# ---------------------------------------------------------------------------------------------- sampling is lossless
@torch.no_grad()
@pytest.mark.parametrize("policy", ["sample", "greedy"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_sampled_tokens_follow_the_target(temperature, top_p, policy, tiny_lm, chi_square_pvalue):
    V, N = 16, 6000
    target, draft = tiny_lm(0, vocab=V), tiny_lm(1, vocab=V)
    prompt = torch.tensor([[3, 9, 4, 9, 4]])
    # Analytic target distributions: first token, and second-token marginal sum_x p(x) p(. | x).
    p1 = probs_from_logits(target(prompt).logits[0, -1], temperature, top_p)                 # (V,)
    both = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
    p2 = p1 @ probs_from_logits(target(both).logits[:, -1], temperature, top_p)              # (V,)
    ids = prompt.expand(N, -1)
    kwargs = dict(max_new_tokens=2, temperature=temperature, top_p=top_p)
    runs = {
        "random": speculative_generate(target, LMDrafter(draft), ids, strategy=2,
                                       generator=torch.Generator().manual_seed(0), draft_policy=policy, **kwargs),
        "ngram": speculative_generate(target, NGramDrafter(), ids, strategy=1,
                                      generator=torch.Generator().manual_seed(1), **kwargs),
        "target": target_generate(target, ids, generator=torch.Generator().manual_seed(2), **kwargs),
    }
    for name, r in runs.items():
        for i, p in enumerate((p1, p2)):
            counts = torch.bincount(r.sequences[:, i], minlength=V)
            assert chi_square_pvalue(counts, p) > 1e-3, f"{name} token {i}"
    rate = runs["random"].acceptance_per_position[0]
    assert 0.02 < rate < 0.98  # both the accept and the resample paths were exercised (over 100 rows each)


@torch.no_grad()
@pytest.mark.parametrize("policy", ["sample", "greedy"])
def test_sampled_tokens_follow_the_target_on_left_padded_prompts_of_different_lengths(
        policy, tiny_lm, chi_square_pvalue, first_three_marginals, interleaved_prompts):
    """One batch mixes three prompt lengths (left padding), and ragged acceptance leaves masked holes in the KV cache
    from the second round on: each row's first three tokens still follow the target alone on its unpadded prompt."""
    V, N = 16, 2000
    target, draft = tiny_lm(0, vocab=V), tiny_lm(1, vocab=V)
    prompts = [[3, 9, 4, 9, 4], [7, 2], [5, 11, 6, 8]]
    K = len(prompts)
    ids, mask = interleaved_prompts(prompts, N)
    out = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=2, max_new_tokens=3, temperature=1.0,
                               generator=torch.Generator().manual_seed(0), draft_policy=policy)
    assert 0.02 < out.acceptance_per_position[0] < 0.98  # accepted and rejected drafts: rows advance unevenly
    for k, prompt in enumerate(prompts):
        rows = out.sequences[k::K]                                                          # (N, 3)
        for i, p in enumerate(first_three_marginals(target, prompt, V)):
            counts = torch.bincount(rows[:, i], minlength=V)
            assert chi_square_pvalue(counts, p) > 1e-3, f"prompt of {len(prompt)} tokens, token {i}"


# ---------------------------------------------------------------------------------------------- gamma policies
def test_dynamic_gamma_grows_shrinks_and_stays_in_bounds():
    policy = DynamicGamma(min_gamma=2, max_gamma=6, init=3, smoothing=0.5)
    seen = []
    for _ in range(10):
        policy.update(policy.gamma(), policy.gamma())  # everything accepted
        seen.append(policy.gamma())
    assert seen[-1] == 6 and seen == sorted(seen)
    for _ in range(10):
        policy.update(policy.gamma(), 0)               # nothing accepted
        seen.append(policy.gamma())
    assert seen[-1] == 2 and all(2 <= g <= 6 for g in seen)
    steady = DynamicGamma(init=4)
    for _ in range(10):
        steady.update(10, 6)                           # 60%: between the thresholds
    assert steady.gamma() == 4
    with pytest.raises(ValueError):
        DynamicGamma(min_gamma=3, max_gamma=2, init=3)


def test_dynamic_gamma_in_the_loop_stays_lossless(tiny_lm, ragged_prompts):
    target = tiny_lm(0)
    ids, mask = ragged_prompts
    reference = target_generate(target, ids, mask, max_new_tokens=24)
    for kind, end in (("self", 6), ("random", 1)):
        policy = DynamicGamma(min_gamma=1, max_gamma=6, init=3)
        r = speculative_generate(target, _drafter(kind, tiny_lm, target), ids, mask, strategy=policy, max_new_tokens=24)
        assert torch.equal(r.sequences, reference.sequences)
        assert policy.gamma() == end and all(0 <= rnd.gamma <= 6 for rnd in r.rounds)
        assert r.accept_hist.shape == (7,)
    assert FixedGamma(3).max_gamma == 3


def test_a_draft_with_a_shorter_context_stays_lossless(tiny_lm, ragged_prompts):
    target = tiny_lm(0)
    ids, mask = ragged_prompts
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    short = LMDrafter(tiny_lm(0, max_positions=12))  # the target's weights, but only 12 positions
    r = speculative_generate(target, short, ids, mask, strategy=4, max_new_tokens=MAX_NEW)
    assert torch.equal(r.sequences, reference.sequences)


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors(tiny_lm):
    target = tiny_lm(0, max_positions=32)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="vocab size 40 != target vocab size 48"):
        speculative_generate(target, LMDrafter(tiny_lm(1, vocab=40)), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        speculative_generate(target, NGramDrafter(), ids[:, :0], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        target_generate(target, torch.tensor([[5, 6], [0, 0]]), torch.tensor([[1, 1], [0, 0]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        speculative_generate(target, NGramDrafter(), torch.ones(1, 30, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(ValueError, match="left-padded"):
        target_generate(target, torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, NGramDrafter(), ids, max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="draft's max_position_embeddings"):
        speculative_generate(tiny_lm(0), LMDrafter(target), torch.ones(1, 40, dtype=torch.long), max_new_tokens=4)
