"""Static KV caches (CacheMode) decode the growing caches' tokens on every architecture of the tiny matrix, and the
compile switch routes the decode forwards, never the prefill, through the model's compiled graphs (one per batch
bucket and step width: tests/decoding/test_compiled_decoding.py checks that each compiles once)."""

import gc

import pytest
import torch

from specdistill.decoding import CacheMode, LMDrafter, compile_stats, speculative_generate, target_generate
from specdistill.drafts.eagle3 import Eagle3Drafter
from specdistill.decoding.kv import BatchKV
from tests.decoding.test_architectures import CASES, MAX_NEW, NOISE, _perturbed, _prompts
from tests.decoding.test_eagle3_drafter import _head, _target
from tests.conftest import left_padded_prompts as _eagle_prompts
from tests.tiny_archs import tiny_target

STATIC = CacheMode(static=True)


@pytest.fixture
def static_compactions(monkeypatch):
    """Counts compactions of static caches (holes and overflow both end there)."""
    count = {"n": 0}
    compact = BatchKV.compact

    def counted(self, *args, **kwargs):
        count["n"] += self.max_length is not None
        return compact(self, *args, **kwargs)

    monkeypatch.setattr(BatchKV, "compact", counted)
    return count


@torch.no_grad()
@pytest.mark.parametrize("arch, attn", CASES)
def test_static_cache_decodes_the_growing_caches_tokens(arch, attn, static_compactions):
    """Greedy, a left-padded batch of 11/6/3-token prompts, drafts accepted and rejected: target-only and speculative
    decoding on static caches (target and LM draft) equal target-only decoding on growing caches."""
    target = tiny_target(arch, attn_implementation=attn)
    drafter = LMDrafter(_perturbed(target, NOISE.get(arch, 0.1)))
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    static = target_generate(target, ids, mask, max_new_tokens=MAX_NEW, cache=STATIC)
    assert torch.equal(static.sequences, reference.sequences), arch
    rejected = 0
    for gamma in (2, 5):
        r = speculative_generate(target, drafter, ids, mask, strategy=gamma, max_new_tokens=MAX_NEW, cache=STATIC)
        assert torch.equal(r.sequences, reference.sequences), f"{arch} gamma={gamma}"
        rejected += sum(int(((rnd.num_accepted < rnd.gamma) & rnd.active).sum()) for rnd in r.rounds)
    assert rejected > 5, f"{arch}: {rejected} rejections"
    assert static_compactions["n"] > 0  # ragged acceptance left holes that the static layers compacted in place


@torch.no_grad()
def test_static_target_cache_is_lossless_with_an_eagle3_head():
    target = _target(sharpen=8.0)
    head = _head(target, 30)
    ids, mask = _eagle_prompts([9, 4, 6])
    reference = target_generate(target, ids, mask, max_new_tokens=16)
    r = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=3, max_new_tokens=16, cache=STATIC)
    assert torch.equal(r.sequences, reference.sequences)


COMPILED = CacheMode(compile=True, backend="eager")  # dynamo's tracer and guards without inductor's kernel builds


@torch.no_grad()
def test_compile_routes_decode_steps_through_the_models_graphs_and_the_prefill_stays_eager():
    torch._dynamo.reset()
    target = tiny_target("llama")
    draft = _perturbed(target, 0.1)
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    for _ in range(2):  # the second call replays both models' graphs
        r = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=3, max_new_tokens=MAX_NEW,
                                 cache=COMPILED)
        assert torch.equal(r.sequences, reference.sequences)
    first = {m: dict(compile_stats(m).compiles) for m in (target, draft)}
    assert torch.equal(target_generate(target, ids, mask, max_new_tokens=MAX_NEW, cache=COMPILED).sequences,
                       reference.sequences)
    assert compile_stats(draft).compiles == first[draft]  # nothing new for the draft; the target's 1-wide graph
    for model in (target, draft):
        stats = compile_stats(model)
        assert set(stats.compiles.values()) == {1} and stats.total_calls > 2 * stats.total_compiles
        widths = {int(name.split("_")[1].removeprefix("width")) for name in stats.compiles}
        assert max(widths) <= 4  # decode steps (1..gamma+1 tokens); prefills of 10 stay eager


def test_compile_implies_a_static_cache_and_a_growing_cache_cannot_compile():
    assert CacheMode(compile=True).factory(40).keywords == {"max_length": 40, "compile": True, "run_length": None,
                                                            "backend": "inductor"}
    assert CacheMode(compile=True, max_length=512).factory(129).keywords["run_length"] == 512
    assert CacheMode(static=True).factory(40).keywords == {"max_length": 40, "compile": False}
    assert CacheMode().factory(40) is BatchKV
    with pytest.raises(ValueError, match="compile=True.*needs a static cache"):
        BatchKV(tiny_target("llama"), compile=True)
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        CacheMode(compile=True, max_length=0)


@torch.no_grad()
def test_compiled_caches_are_reused_by_later_calls_of_the_same_bucket():
    """Compiled graphs replay on the same addresses: a cache returns to the model when its BatchKV is gone, and a
    BatchKV alive at the same time gets its own."""
    model = tiny_target("llama")
    ids, mask = _prompts()

    def filled() -> BatchKV:
        kv = COMPILED.factory(30)(model)
        kv.prefill(ids, mask)
        return kv

    first, other = filled(), filled()  # both alive: a cache each
    caches = [first.cache, other.cache]
    assert caches[0].layers[0].keys.data_ptr() != caches[1].layers[0].keys.data_ptr()
    del first, other
    gc.collect()
    again = filled()
    assert any(again.cache is cache for cache in caches)
    assert again.cache.layers[0].start == ids.shape[1]  # its write position restarted at 0
    assert again.cache.layers[0].keys.shape[0] == 4  # 3 rows padded up to the batch bucket
