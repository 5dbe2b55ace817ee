"""speculative_generate(drop_finished_rows=True): rows that stop leave both models' batches, and nothing else changes.

At T=0 the decode with drops equals the decode without, for every drafter kind and for chains and trees: tokens,
counters, kept features, the evaluator's per-row figures and the on-policy positions built from the records; while
the target's forwards really ran fewer rows."""

import copy

import pytest
import torch

from specdistill.decoding import LMDrafter, NGramDrafter, speculative_generate
from specdistill.decoding.drafters import OracleDrafter
from specdistill.decoding.kv import BatchKV, CacheMode, TokenBuffer
from specdistill.decoding.tree import TreeShape
from specdistill.drafts.dflash import DFlashDrafter
from specdistill.drafts.eagle3 import Eagle3Drafter
from specdistill.eval.metrics import row_acceptance
from specdistill.onpolicy.positions import positions_from_rounds
from specdistill.output_positions import output_position_buckets
from tests.conftest import left_padded_prompts, make_tiny_lm, noisy_eagle3_head
from tests.dflash.conftest import tiny_dflash

V, NEW = 48, 20
EOS = [10, 16]  # the target ends two of the six rows early with these (the rest stop at the budget)


def _target():
    target = make_tiny_lm(V, layers=4, hidden=32, seed=0).eval()  # aux ids default to (1, 2, 3)
    target.lm_head.weight.data.mul_(4.0)  # peaked distributions: drafts get accepted
    return target


def _near_copy(target):
    """A draft close to the target: ragged acceptance, so rows reach their budgets at different rounds."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    return draft


def _drafter(kind: str, target, ids, mask):
    if kind == "lm":
        return LMDrafter(_near_copy(target))
    if kind == "eagle3":
        return Eagle3Drafter(noisy_eagle3_head(target, 40).eval())
    if kind == "dflash":
        return DFlashDrafter(tiny_dflash(target, 5))
    if kind == "ngram":
        return NGramDrafter()
    oracle = OracleDrafter(target, NEW)
    oracle.prepare(ids, mask)
    return oracle


def _decode(kind, target, ids, mask, drop, strategy=3, capture=None):
    rows_fed = []
    drafter = _drafter(kind, target, ids, mask)  # before the hook: a near copy of the target would copy it
    hook = target.register_forward_hook(lambda m, a, kw, out: rows_fed.append(kw["input_ids"].shape[0]),
                                        with_kwargs=True)
    try:
        r = speculative_generate(target, drafter, ids, mask, strategy=strategy,
                                 max_new_tokens=NEW, eos_token_id=EOS, record=True, capture_layers=capture,
                                 drop_finished_rows=drop)
    finally:
        hook.remove()
    return r, rows_fed


@pytest.mark.parametrize("kind", ["lm", "eagle3", "dflash", "ngram", "oracle"])
def test_dropping_stopped_rows_decodes_the_same_tokens_with_fewer_rows_per_forward(kind):
    torch.manual_seed(0)
    target = _target()
    ids, mask = left_padded_prompts([9, 5, 2, 7, 4, 8], seed=3)
    capture = [1, 4] if kind == "eagle3" else None
    full, fed_full = _decode(kind, target, ids, mask, drop=False, capture=capture)
    torch.manual_seed(0)
    cut, fed_cut = _decode(kind, target, ids, mask, drop=True, capture=capture)

    assert torch.equal(cut.sequences, full.sequences)
    assert torch.equal(cut.num_new_tokens, full.num_new_tokens)
    for name in ("target_forwards", "accept_hist", "position_proposed", "position_accepted"):
        assert torch.equal(getattr(cut, name), getattr(full, name)), name
    assert torch.allclose(cut.position_alpha, full.position_alpha)
    if capture:
        assert torch.allclose(cut.hidden, full.hidden, atol=1e-5)
    # the evaluator's per-row figures read the records' rows
    G = 3
    assert torch.equal(row_acceptance(cut, G).reached, row_acceptance(full, G).reached)
    assert torch.equal(row_acceptance(cut, G).accepted, row_acceptance(full, G).accepted)
    for a, b in zip(output_position_buckets(cut.rounds, (0, 8)), output_position_buckets(full.rounds, (0, 8))):
        assert torch.equal(a.rounds, b.rounds) and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.accepted, b.accepted) and torch.equal(a.proposed, b.proposed)

    # the rows really left: same number of rounds, fewer row-forwards, and the records say which rows ran
    assert len(fed_cut) == len(fed_full)
    stopped_early = int(full.target_forwards.max() - full.target_forwards.min())
    assert stopped_early > 0, "the prompts must stop at different rounds for this test to mean anything"
    # after the prefill (packed: its own row count), every row in every round / only the rows still going
    assert sum(fed_full[1:]) == (len(fed_full) - 1) * ids.shape[0]
    assert sum(fed_cut[1:]) == int(full.target_forwards.sum()) < sum(fed_full[1:])
    assert any(rnd.rows is not None for rnd in cut.rounds)


@pytest.mark.parametrize("strategy", [3, TreeShape(topk=2, depth=3, nodes=5)], ids=["chain", "tree"])
def test_on_policy_positions_from_a_decode_with_drops_are_the_positions_without(strategy):
    target = _target()
    ids, mask = left_padded_prompts([9, 5, 2, 7, 4, 8], seed=3)
    full, _ = _decode("lm", target, ids, mask, drop=False, strategy=strategy)
    cut, _ = _decode("lm", target, ids, mask, drop=True, strategy=strategy)
    assert any(rnd.rows is not None for rnd in cut.rounds)
    a = positions_from_rounds(ids, mask, full, 0, True)
    b = positions_from_rounds(ids, mask, cut, 0, True)
    assert len(a) > 0 and len(a.rows) > ids.shape[0], "branch rows included"
    assert [r.tolist() for r in a.rows] == [r.tolist() for r in b.rows] and a.source == b.source
    for name in ("row", "context_len", "token", "category", "accepted", "round_id", "index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.allclose(a.alpha, b.alpha)
    assert torch.allclose(a.target.values, b.target.values, atol=1e-5)
    if a.parent is not None:
        assert torch.equal(a.parent, b.parent) and torch.allclose(a.edge, b.edge)


def test_sampled_decodes_with_drops_are_reproducible_and_stop_where_the_rows_end():
    target = _target()
    ids, mask = left_padded_prompts([9, 5, 2, 7, 4, 8], seed=3)

    def run():
        g = torch.Generator().manual_seed(7)
        return speculative_generate(target, LMDrafter(_near_copy(target)), ids, mask, strategy=3,
                                    max_new_tokens=NEW, eos_token_id=EOS, temperature=1.0, generator=g,
                                    drop_finished_rows=True)

    a, b = run(), run()
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.target_forwards, b.target_forwards)
    for row in range(ids.shape[0]):  # each row ends at its budget or right after its first EOS
        tokens = a.tokens(row)
        ends = [i for i, t in enumerate(tokens) if t in EOS]
        assert len(tokens) == (ends[0] + 1 if ends else NEW)


def test_static_caches_keep_their_rows():
    target = _target()
    ids, mask = left_padded_prompts([9, 5, 2], seed=3)
    r = speculative_generate(target, LMDrafter(_near_copy(target)), ids, mask, strategy=3, max_new_tokens=NEW,
                             eos_token_id=EOS, cache=CacheMode(static=True), drop_finished_rows=True)
    assert all(rnd.rows is None for rnd in r.rounds)
    kv = BatchKV(target, max_length=64)
    kv.prefill(ids, mask)
    with pytest.raises(ValueError, match="growing cache"):
        kv.select_rows(torch.tensor([0, 2]))


def test_selected_cache_rows_continue_as_those_rows_alone():
    """BatchKV.select_rows then a step == the kept rows' own cache stepping (keys, masks and positions moved along)."""
    target = _target()
    ids, mask = left_padded_prompts([9, 5, 2, 7], seed=3)
    kv = BatchKV(target)
    kv.prefill(ids, mask)
    keep = torch.tensor([3, 1])
    kv.select_rows(keep)
    nxt = torch.tensor([[11], [12]])
    got = kv.step(nxt).logits[:, -1]
    alone = BatchKV(target)
    alone.prefill(ids[keep], mask[keep])
    assert torch.allclose(got, alone.step(nxt).logits[:, -1], atol=1e-5)
    buf = TokenBuffer(4, 8, torch.device("cpu"))
    buf.append(torch.arange(8).view(4, 2), torch.tensor([2, 1, 0, 2]))
    sub = buf.select_rows(keep)
    sub.append(torch.tensor([[40], [41]]), torch.tensor([1, 1]))
    assert sub.tokens[0, :3].tolist() == [6, 7, 40] and sub.tokens[1, :2].tolist() == [2, 41]
    assert buf.length.tolist() == [2, 1, 0, 2]  # the source buffer is untouched
