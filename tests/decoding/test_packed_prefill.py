"""A ragged prefill runs packed (several prompts to a row, each attending to itself) and leaves the cache, the
hidden states and every later step exactly as the left-padded prefill does."""

import pytest
import torch

import specdistill.decoding.kv as kv
from specdistill.decoding.kv import CacheMode, pack_rows
from tests.conftest import left_padded_prompts
from tests.tiny_archs import tiny_target


@pytest.mark.parametrize("lengths, width", [([9, 3, 2, 7, 1, 4, 1, 8], 9), ([5, 5, 5], 5), ([4, 0, 1, 3, 2], 6),
                                            ([1] * 12, 4)])
def test_packing_places_every_real_token_once_in_fewer_rows(lengths, width):
    packing = pack_rows(lengths, width)
    real = [n for n in lengths if n]
    if sum(real) > width * (len(lengths) - 1):
        assert packing is None  # nothing to save
        return
    N = packing.segment.shape[0]
    assert N < len(lengths)
    (src_row, src_col), (at_bin, at_col) = packing.source, packing.target
    for b, n in enumerate(lengths):
        slots = (packing.segment == b).nonzero()                            # (n, 2) the packed slots of row b
        assert len(slots) == n
        if n == 0:
            continue
        # in order, contiguous, reading row b's real columns, and the batch layout reads them back
        assert torch.equal(src_row[slots[:, 0], slots[:, 1]], torch.full((n,), b))
        assert src_col[slots[:, 0], slots[:, 1]].tolist() == list(range(width - n, width))
        assert len(set(slots[:, 0].tolist())) == 1 and slots[:, 1].diff().eq(1).all()
        assert at_bin[b, width - n:].tolist() == slots[:, 0].tolist()
        assert at_col[b, width - n:].tolist() == slots[:, 1].tolist()
    assert ((packing.segment >= 0).sum(1) <= width).all()


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])  # full, hybrid sliding/full, all sliding
@pytest.mark.parametrize("static", [False, True])
@torch.no_grad()
def test_a_packed_prefill_leaves_the_cache_and_features_of_the_padded_one(monkeypatch, arch, static):
    model = tiny_target(arch).eval()
    ids, mask = left_padded_prompts([9, 3, 2, 7, 1, 4, 1, 8], seed=2, vocab=model.config.vocab_size)
    new_kv = CacheMode(static=static).factory(32)
    rows = []
    hook = model.register_forward_hook(lambda m, a, k, o: rows.append(k["input_ids"].shape[0]), with_kwargs=True)
    packed = new_kv(model)
    out_p = packed.prefill(ids, mask, output_hidden_states=True)
    monkeypatch.setattr(kv, "pack_rows", lambda *a: None)
    padded = new_kv(model)
    out_f = padded.prefill(ids, mask, output_hidden_states=True)
    hook.remove()
    assert rows == [4, 8]  # 8 prompts of <= 9 tokens in 4 rows of 9, then the padded batch
    valid = mask.bool()
    for a, b in zip(packed.cache.layers, padded.cache.layers):
        assert torch.allclose(a.keys.transpose(1, 2)[:, :9][valid], b.keys.transpose(1, 2)[:, :9][valid], atol=1e-5)
        assert torch.allclose(a.values.transpose(1, 2)[:, :9][valid], b.values.transpose(1, 2)[:, :9][valid],
                              atol=1e-5)
    for a, b in zip(out_p.hidden_states, out_f.hidden_states):
        assert torch.allclose(a[valid], b[valid], atol=1e-5)
        assert not a[~valid].any()  # padding columns hold zeros
    assert torch.equal(packed.mask, padded.mask) and torch.equal(packed.length, padded.length)
    assert torch.equal(packed.positions[valid], padded.positions[valid])
    step = torch.randint(3, model.config.vocab_size, (8, 3), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(packed.step(step).logits, padded.step(step).logits, atol=1e-5)
