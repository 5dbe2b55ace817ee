"""Static KV caches (CacheMode) decode the growing caches' tokens on every architecture of the tiny matrix, and the
compile switch routes the decode forwards, never the prefill, through one compiled callable per model."""

import gc

import pytest
import torch

from specdistill.decoding import CacheMode, LMDrafter, speculative_generate, target_generate
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
        r = speculative_generate(target, drafter, ids, mask, gamma=gamma, max_new_tokens=MAX_NEW, cache=STATIC)
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
    r = speculative_generate(target, Eagle3Drafter(head), ids, mask, gamma=3, max_new_tokens=16, cache=STATIC)
    assert torch.equal(r.sequences, reference.sequences)


class _FakeCompile:
    """Stands in for torch.compile: returns the function itself, recording each compile and each call's width."""

    def __init__(self):
        self.compiled, self.widths = 0, []

    def __call__(self, fn, **kwargs):
        self.compiled += 1

        def run(*args, **inputs):
            self.widths.append(inputs["input_ids"].shape[1])
            return fn(*args, **inputs)

        return run


@torch.no_grad()
def test_compile_routes_decode_steps_through_one_compiled_forward_per_model(monkeypatch):
    fake = _FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    target = tiny_target("llama")
    draft = _perturbed(target, 0.1)
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    compiled = CacheMode(compile=True)
    for _ in range(2):  # the second call reuses both models' compiled forwards
        r = speculative_generate(target, LMDrafter(draft), ids, mask, gamma=3, max_new_tokens=MAX_NEW, cache=compiled)
        assert torch.equal(r.sequences, reference.sequences)
    assert torch.equal(target_generate(target, ids, mask, max_new_tokens=MAX_NEW, cache=compiled).sequences,
                       reference.sequences)
    assert fake.compiled == 2  # target and draft, once each
    assert fake.widths and max(fake.widths) <= 4  # decode steps (1..gamma+1 tokens); prefills of 10 stay eager


def test_compile_implies_a_static_cache_and_a_growing_cache_cannot_compile():
    assert CacheMode(compile=True).factory(40).keywords == {"max_length": 64, "compile": True}  # powers of two
    assert CacheMode(compile=True).factory(129).keywords["max_length"] == 256
    assert CacheMode(static=True).factory(40).keywords == {"max_length": 40, "compile": False}
    assert CacheMode().factory(40) is BatchKV
    with pytest.raises(ValueError, match="compile=True.*needs a static cache"):
        BatchKV(tiny_target("llama"), compile=True)


@torch.no_grad()
def test_compiled_caches_are_reused_by_later_calls_of_the_same_shape(monkeypatch):
    """Compiled graphs replay on the same addresses: a cache returns to the pool when its BatchKV is gone, and a
    BatchKV alive at the same time gets its own."""
    monkeypatch.setattr(torch, "compile", _FakeCompile())
    model = tiny_target("llama")
    ids, mask = _prompts()

    def filled() -> BatchKV:
        kv = CacheMode(compile=True).factory(30)(model)
        kv.prefill(ids, mask)
        return kv

    first, other = filled(), filled()  # both alive: a cache each
    caches = [first.cache, other.cache]
    assert caches[0].layers[0].keys.data_ptr() != caches[1].layers[0].keys.data_ptr()
    del first, other
    gc.collect()
    again = filled()
    assert any(again.cache is cache for cache in caches)
    assert int(again.cache.layers[0].cumulative_length) == ids.shape[1]  # its write position restarted at 0


@torch.no_grad()
def test_dynamo_traces_compiled_decoding_to_the_eager_tokens(monkeypatch):
    """torch.compile's tracer on the real decode steps (its eager backend: no inductor kernels, which a GPU check
    covers): the cache object, padded masks and cloned outputs trace, and the tokens stay the growing caches'."""
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile(fn, backend="eager"))
    torch._dynamo.reset()
    target = tiny_target("llama")
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=12)
    compiled = CacheMode(compile=True)
    assert torch.equal(target_generate(target, ids, mask, max_new_tokens=12, cache=compiled).sequences,
                       reference.sequences)
    r = speculative_generate(target, LMDrafter(_perturbed(target, 0.1)), ids, mask, gamma=3, max_new_tokens=12,
                             cache=compiled)
    assert torch.equal(r.sequences, reference.sequences)
