"""Drafters: prompt lookup proposes the continuation of the latest n-gram match; LM drafts follow the model."""

import pytest
import torch

from specdistill.decoding.drafters import LMDrafter, NGramDrafter
from specdistill.decoding.sampling import Sampler
from specdistill.decoding.tree import TreeShape

GREEDY = Sampler(0.0)


def _ngram(rows, k, **kwargs):
    """Left-pad rows (lists of ids >= 1), start an NGramDrafter, propose k."""
    T = max(map(len, rows))
    ids = torch.tensor([[0] * (T - len(r)) + r for r in rows])
    drafter = NGramDrafter(**kwargs)
    drafter.start(ids, (ids > 0).long())
    return drafter, drafter.propose(TreeShape.chain(k), GREEDY)


def test_ngram_proposes_the_continuation_with_its_period():
    _, p = _ngram([[5, 6, 7, 8, 5, 6]], 5)  # "5 6" occurred before, followed by 7 8, then the pattern repeats
    assert p.tokens.tolist() == [[7, 8, 5, 6, 7]] and p.probs is None


def test_ngram_prefers_the_most_recent_and_the_longest_match():
    _, p = _ngram([[1, 2, 3, 1, 2, 4, 1, 2]], 2)
    assert p.tokens.tolist() == [[4, 1]]  # latest "1 2" was followed by 4
    ctx = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    assert _ngram([ctx], 1, max_ngram=3)[1].tokens.tolist() == [[4]]  # "1 2 3" -> 4
    assert _ngram([ctx], 1, max_ngram=2)[1].tokens.tolist() == [[5]]  # "2 3" (latest) -> 5


def test_ngram_without_match_repeats_the_last_token_and_rows_are_independent():
    _, p = _ngram([[3, 4, 5], [7, 8, 7, 8, 9, 7]], 3, min_ngram=1)
    # Row 1: no earlier "8 9 7" or "9 7"; the latest earlier "7" (index 2) was followed by 8 9 7.
    assert p.tokens.tolist() == [[5, 5, 5], [8, 9, 7]]


def test_ngram_with_no_match_in_any_row_proposes_nothing_and_commit_keeps_the_next_token():
    drafter, p = _ngram([[3, 4, 5], [6, 7, 8]], 4)
    assert p.tokens.shape == (2, 0)  # a 1-token target step instead of verifying filler
    drafter.commit(torch.zeros(2, dtype=torch.long), torch.tensor([9, 6]), torch.tensor([True, True]))
    p2 = drafter.propose(TreeShape.chain(2), Sampler(0.0))
    assert p2.tokens.tolist() == [[9, 9], [7, 8]]  # row 1 ends "6 7 8 6": "6" was followed by 7 8; row 0 repeats


def test_ngram_commit_appends_accepted_drafts_and_next_token():
    drafter, p = _ngram([[1, 2, 3, 1, 2], [4, 5]], 2)
    drafter.commit(torch.tensor([1, 2]), torch.tensor([9, 8]), torch.tensor([True, False]))
    ctx = drafter.context
    assert ctx.length.tolist() == [7, 2]
    assert ctx.tokens[0, :7].tolist() == [1, 2, 3, 1, 2, 3, 9]  # accepted "3", then 9
    assert ctx.tokens[1, :2].tolist() == [4, 5]                 # stopped row keeps nothing


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(max_ngram=2, min_ngram=3)


@torch.no_grad()
def test_lm_drafter_greedy_proposal_is_the_models_argmax_chain(tiny_lm, ragged_prompts):
    model = tiny_lm(1)
    ids, mask = ragged_prompts
    drafter = LMDrafter(model)
    drafter.start(ids, mask)
    proposal = drafter.propose(TreeShape.chain(4), GREEDY)
    assert proposal.tokens.shape == (4, 4) and proposal.probs is None
    for b in range(4):
        seq = ids[b][mask[b].bool()].tolist()
        for k in range(4):
            assert int(model(torch.tensor([seq])).logits[0, -1].argmax()) == int(proposal.tokens[b, k])
            seq.append(int(proposal.tokens[b, k]))
    assert drafter.vocab_size == 48


def test_lm_drafter_confidence_stops_once_every_row_is_unsure(tiny_lm, ragged_prompts):
    """The round stops after the first draft step at which every row's draft probability is below the threshold;
    that draft is still proposed, and the drafted prefix is the unthresholded chain's."""
    model = tiny_lm(1)
    ids, mask = ragged_prompts
    full = LMDrafter(model)
    full.start(ids, mask)
    chain = full.propose(TreeShape.chain(6), GREEDY).tokens
    # the greedy draft's own probability at each step, per row
    conf = []
    for b in range(len(ids)):
        seq = ids[b][mask[b].bool()].tolist()
        row = []
        for k in range(6):
            row.append(model(torch.tensor([seq])).logits[0, -1].float().softmax(-1).max().item())
            seq.append(int(chain[b, k]))
        conf.append(row)
    conf = torch.tensor(conf)                                               # (B, 6)
    threshold = float(conf.max(0).values.median())
    expect = next((k + 1 for k in range(6) if bool((conf[:, k] < threshold).all())), 6)
    d = LMDrafter(model, confidence=threshold)
    d.start(ids, mask)
    got = d.propose(TreeShape.chain(6), GREEDY).tokens
    assert got.shape[1] == expect and torch.equal(got, chain[:, :expect])
    with pytest.raises(ValueError, match="confidence"):
        LMDrafter(model, confidence=1.0)
