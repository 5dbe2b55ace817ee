"""Rollback is exact: after ragged commits the cache equals a fresh prefill of each row's kept tokens."""

import pytest
import torch

from specdistill.decoding.drafters import LMDrafter
from specdistill.decoding.kv import BatchKV, TokenBuffer
from specdistill.decoding.sampling import Sampler
from specdistill.decoding.tree import TreeShape
from tests.tiny_archs import tiny_target


def _real_rows(kv: BatchKV, row: int):
    """Per layer, (keys, values) of the row's real columns: (H, n, D) each."""
    real = kv.mask[row].bool()
    return [(layer.keys[row][:, real], layer.values[row][:, real]) for layer in kv.cache.layers]


def _fresh(model, tokens: list[int]) -> BatchKV:
    kv = BatchKV(model)
    ids = torch.tensor([tokens])
    kv.prefill(ids, torch.ones_like(ids))
    return kv


def _prefilled(kv: BatchKV, ids: torch.Tensor, mask: torch.Tensor) -> tuple[BatchKV, list[list[int]]]:
    """The cache after prefilling left-padded ids / mask (B, T), and each row's real tokens."""
    kv.prefill(ids, mask)
    return kv, [ids[b][mask[b].bool()].tolist() for b in range(len(ids))]


def _assert_cache_is_fresh(model, kv: BatchKV, row: int, tokens: list[int]):
    fresh = _fresh(model, tokens)
    assert int(kv.length[row]) == len(tokens) == int(kv.mask[row].sum())
    for (k, v), (fk, fv) in zip(_real_rows(kv, row), _real_rows(fresh, 0)):
        assert torch.allclose(k, fk, atol=1e-5) and torch.allclose(v, fv, atol=1e-5)


@torch.no_grad()
def test_ragged_commits_equal_fresh_prefill(tiny_lm, ragged_prompts):
    model = tiny_lm(0)
    ids, mask = ragged_prompts
    kv, rows = _prefilled(BatchKV(model), ids, mask)
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(4, 4, dtype=torch.long)
    rounds = [  # (valid slots fed, slots kept): the kept ones are a prefix of each row's real slots
        (ones, torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]])),  # ragged rollback
        (torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 1]]),         # padding slots (holes)
         torch.tensor([[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 1]])),
        (ones, ones),                                                                    # everything
        (ones, 0 * ones),                                                                # nothing
    ]
    for i, (valid, keep) in enumerate(rounds):
        new = torch.randint(3, 48, (4, 4), generator=g)
        kv.step(new, valid.bool())
        kv.commit(keep.bool())
        if i == 1:
            kv.compact()  # right-align rows and drop all-padding columns
            assert kv.mask.shape[1] == max(len(r) + int(k.sum()) for r, k in zip(rows, keep)) == kv.committed
        for b in range(4):
            rows[b] += new[b][keep[b].bool()].tolist()
            _assert_cache_is_fresh(model, kv, b, rows[b])
    # Next-token logits from the rolled-back batch equal a fresh forward over each row's whole sequence.
    nxt = torch.randint(3, 48, (4, 1), generator=g)
    logits = kv.step(nxt).logits[:, -1]
    for b in range(4):
        full = torch.tensor([rows[b] + nxt[b].tolist()])
        assert torch.allclose(logits[b], model(full).logits[0, -1], atol=1e-5)


@torch.no_grad()
def test_lm_drafter_rollback_and_next_proposal_match_fresh_model(tiny_lm, ragged_prompts):
    draft = tiny_lm(1)
    ids, mask = ragged_prompts
    drafter = LMDrafter(draft)
    drafter.start(ids, mask)
    seqs = [ids[b][mask[b].bool()].tolist() for b in range(4)]
    sampler = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0))
    rounds = [(3, [3, 1, 0, 2], [1, 1, 1, 1]), (4, [0, 4, 2, 4], [1, 1, 0, 1]), (2, [2, 2, 1, 0], [1, 1, 0, 1])]
    for k, n, active in rounds:
        proposal = drafter.propose(TreeShape.chain(k), sampler)
        for b in range(4):  # each q_k is the draft's distribution after the row's sequence + earlier drafts
            if active[b]:
                ctx = torch.tensor([seqs[b] + proposal.tokens[b, :2].tolist()])
                fresh = torch.softmax(draft(ctx).logits[0, -3:], -1)
                assert torch.allclose(proposal.probs[b, : min(k, 3)], fresh[: min(k, 3)], atol=1e-5)
        nxt = torch.randint(3, 48, (4,), generator=torch.Generator().manual_seed(k))
        drafter.commit(torch.tensor(n), nxt, torch.tensor(active).bool())
        for b in range(4):
            if active[b]:
                seqs[b] += proposal.tokens[b, : n[b]].tolist() + [int(nxt[b])]
        # The drafter's cache holds all but its pending tokens, exactly as a fresh prefill would.
        for b in range(4):
            if active[b]:
                pending = int(drafter.pending_valid[b].sum())
                _assert_cache_is_fresh(draft, drafter.kv, b, seqs[b][:-pending])
                assert drafter.pending[b, :pending].tolist() == seqs[b][-pending:]


@torch.no_grad()
def test_holes_from_ragged_acceptance_are_compacted(tiny_lm, ragged_prompts):
    model = tiny_lm(0)
    ids, mask = ragged_prompts
    kv, rows = _prefilled(BatchKV(model), ids, mask)
    g = torch.Generator().manual_seed(1)
    widths = []
    for i in range(30):  # one row keeps all 5 slots, the others 1, a different row each round: holes pile up
        new = torch.randint(3, 48, (4, 5), generator=g)
        kept = [5 if b == i % 4 else 1 for b in range(4)]
        kv.step(new)
        kv.commit(torch.arange(5) < torch.tensor(kept)[:, None])
        for b in range(4):
            rows[b] += new[b, : kept[b]].tolist()
        widths.append(kv.mask.shape[1])
        longest = max(map(len, rows))
        # Padding for the widest row stays within max(32, width / 4).
        assert widths[-1] - longest <= max(32, widths[-1] // 4)
    assert any(w2 < w1 for w1, w2 in zip(widths, widths[1:]))  # compaction happened
    for b in range(4):
        _assert_cache_is_fresh(model, kv, b, rows[b])


@torch.no_grad()
@pytest.mark.parametrize("arch", ["gemma3", "mistral", "llama"])  # hybrid; every layer sliding; no sliding
@pytest.mark.parametrize("max_length", [None, 40])  # growing cache; static layers that must compact to fit
def test_ragged_commits_equal_fresh_forwards_for_every_layer_layout(arch, max_length):
    """Windows of 4 real tokens, rows that keep different counts, padding slots and left padding: every forward's
    logits equal the model's own (transformers' sliding mask) on each row's real tokens alone, unpadded."""
    model = tiny_target(arch, **({} if arch == "llama" else {"sliding_window": 4}))
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 5, 2])
    mask = (torch.arange(9) >= 9 - lengths[:, None]).long()                # (3, 9) left-padded
    ids = torch.randint(3, 300, (3, 9), generator=g) * mask
    kv, rows = _prefilled(BatchKV(model, max_length=max_length), ids, mask)
    for _ in range(12):  # ~3 tokens kept per row and round: rows pass the window ~8 times, with holes behind them
        new = torch.randint(3, 300, (3, 4), generator=g)
        valid = torch.rand(3, 4, generator=g) > 0.2                        # some padding slots mid-tail
        valid[:, 0] = True
        logits = kv.step(new, valid).logits                                # (3, 4, V)
        kept = torch.randint(0, 5, (3,), generator=g)
        keep = (valid.long().cumsum(1) <= kept[:, None]) & valid             # a prefix of each row's real slots
        for b in range(3):
            fed = rows[b] + new[b][valid[b]].tolist()
            fresh = model(torch.tensor([fed])).logits[0, len(rows[b]):]     # (real tail slots, V)
            assert torch.allclose(logits[b][valid[b]], fresh, atol=1e-5), f"{arch} row {b}"
            rows[b] += new[b][keep[b]].tolist()
        kv.commit(keep)
    assert min(map(len, rows)) > 3 * 4
    if max_length is not None:  # rows outgrew the window and the static layers kept their addresses
        assert max(map(len, rows)) > 4 and all(layer.keys.shape[2] == max_length for layer in kv.cache.layers)


@torch.no_grad()
def test_a_hybrid_cache_drops_old_columns_from_its_sliding_layers_only():
    """Gemma-3 layout: full layers keep every column, sliding layers lose those out of every row's window; a
    compaction in between (ragged keeps leave holes) re-aligns both. Logits stay those of fresh forwards."""
    model = tiny_target("gemma3", sliding_window=4)
    kv = BatchKV(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 5), generator=g)
    kv.prefill(ids, torch.ones_like(ids))
    rows = [ids[b].tolist() for b in range(2)]
    cropped = compacted = False
    width = 0
    for i in range(40):
        new = torch.randint(3, 300, (2, 4), generator=g)
        logits = kv.step(new).logits                                        # (2, 4, V)
        for b in range(2):
            assert torch.allclose(logits[b], model(torch.tensor([rows[b] + new[b].tolist()])).logits[0, -4:],
                                  atol=1e-5), f"round {i} row {b}"
        kept = [4, 1] if i % 10 < 5 else [1, 4]                             # rows drift apart, then back
        kv.commit(torch.arange(4) < torch.tensor(kept)[:, None])
        for b in range(2):
            rows[b] += new[b, : kept[b]].tolist()
        full, sliding = kv.cache.layers[1].keys.shape[2], kv.cache.layers[0].keys.shape[2]
        cropped |= sliding < full
        compacted |= full < width
        width = full
        assert sliding == full - kv.front == kv.cache.layers[2].keys.shape[2]
    assert cropped and compacted


def test_a_static_cache_too_small_for_the_real_tokens_says_so():
    kv = BatchKV(tiny_target("llama"), max_length=8)
    ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    kv.prefill(ids, torch.ones_like(ids))
    with pytest.raises(ValueError, match="static KV cache of 8 columns cannot hold 6 real tokens plus 3 new"):
        kv.step(ids[:, :3])


@torch.no_grad()
def test_a_cache_whose_layers_all_slide_stays_near_the_window():
    """Keys behind every row's window are dead: they are masked and compacted away, the cache stays bounded."""
    model = tiny_target("mistral", sliding_window=4)
    kv = BatchKV(model)
    ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    kv.prefill(ids, torch.ones_like(ids))
    widths = []
    for _ in range(40):
        kv.step(ids[:, :3])
        kv.commit()
        widths.append(kv.mask.shape[1])
        assert int(kv.mask.sum(1).max()) <= 4 - 1                            # only the window's keys stay real
    assert max(widths) <= 4 + 32 + 3 and kv.length.tolist() == [6 + 3 * 40] * 2


def test_token_buffer_appends_ragged_counts_and_grows():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])
    buf = TokenBuffer.from_prompt(ids, (ids > 0).long(), extra=1)
    for _ in range(3):
        buf.append(torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([3, 1]))
    assert buf.length.tolist() == [11, 7]
    assert buf.tokens[0, :11].tolist() == [5, 6] + [1, 2, 3] * 3
    assert buf.tokens[1, :7].tolist() == [7, 8, 9, 4, 1, 1, 1]
