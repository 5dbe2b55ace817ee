"""Compiled decoding compiles each graph once (per model, batch bucket and step width) and decodes the eager tokens;
a guard that fails raises instead of recompiling; static caches hand attention the columns a growing cache does.

The compiled tests run torch.compile with backend="eager": dynamo traces, guards and (re)compiles exactly as with
inductor (guards and recompiles are dynamo's, independent of the backend), without inductor's C++ kernel builds,
which take minutes on two CPU cores. Inductor's kernels: test_inductor_decoding.py (C++ on the CPU) and
scripts/gpu_check.py (a GPU's)."""

import gc
import weakref

import pytest
import torch

from specdistill.decoding import (BATCH_BUCKETS, CacheMode, LMDrafter, RecompileError, batch_bucket, compile_stats,
                                  speculative_generate, target_generate)
from specdistill.decoding.compiled import ColumnLayer, decoding_of, release
from specdistill.decoding.kv import BatchKV
from tests.conftest import left_padded_prompts
from tests.decoding.test_architectures import _perturbed
from tests.tiny_archs import tiny_target

COMPILED = CacheMode(compile=True, backend="eager")
MAX_NEW = 10


@pytest.fixture
def no_recompiles():
    """Any dynamo recompile anywhere raises (torch._dynamo.config.error_on_recompile)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def _batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_prompts(lengths, seed=seed, vocab=320)


def test_batch_buckets_are_the_smallest_bucket_that_holds_the_batch():
    for batch in range(1, 300):
        bucket = batch_bucket(batch)
        assert bucket >= batch
        assert bucket in BATCH_BUCKETS or bucket % BATCH_BUCKETS[-1] == 0
        smaller = [b for b in BATCH_BUCKETS if b < bucket] + [bucket - BATCH_BUCKETS[-1]]
        assert all(b < batch for b in smaller)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        batch_bucket(0)


@torch.no_grad()
def test_prompts_of_other_lengths_and_batch_sizes_reuse_the_warm_graphs(no_recompiles):
    """After warm-up on buckets 4 and 2, target-only decoding of batches of 2..4 rows with prompts of 2..13 tokens
    compiles nothing (same graphs, same cache length), and every output is the eager growing cache's."""
    target = tiny_target("llama")
    for lengths in ([11, 6, 3], [5, 2]):  # warm-up: buckets 4 and 2
        target_generate(target, *_batch(lengths, 0), max_new_tokens=MAX_NEW, cache=COMPILED)
    warm = dict(compile_stats(target).compiles)
    assert warm and set(warm.values()) == {1}
    for seed, lengths in enumerate([[13, 2, 7, 9], [4, 8, 2], [12, 3], [2, 9]]):
        ids, mask = _batch(lengths, seed)
        rollout = target_generate(target, ids, mask, max_new_tokens=MAX_NEW, cache=COMPILED)
        assert torch.equal(rollout.sequences, target_generate(target, ids, mask, max_new_tokens=MAX_NEW).sequences)
    stats = compile_stats(target)
    assert stats.compiles == warm, "a prompt length or batch size inside a warm bucket compiled a graph"
    assert stats.recompiles == 0 and stats.calls[next(iter(warm))] > len(warm) * MAX_NEW


@torch.no_grad()
def test_speculative_decoding_compiles_each_graph_once_and_keeps_the_eager_tokens(no_recompiles):
    """Verification widths, draft widths and buckets each compile once over several calls (dynamo raising on any
    recompile), for the target and the LM draft, and greedy output stays the target's."""
    target = tiny_target("llama")
    drafter = LMDrafter(_perturbed(target, 0.1))
    for seed, lengths in enumerate([[11, 6, 3], [4, 9, 7, 5]]):  # one bucket: fewer graphs to trace
        ids, mask = _batch(lengths, seed)
        reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
        rollout = speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=MAX_NEW, cache=COMPILED)
        assert torch.equal(rollout.sequences, reference.sequences), lengths
    for model in (target, drafter.model):
        stats = compile_stats(model)
        assert stats.total_compiles > 0 and set(stats.compiles.values()) == {1}, stats.compiles
        assert stats.total_calls > stats.total_compiles  # graphs replayed, not compiled per step
    widths = {int(name.split("_")[1].removeprefix("width")) for name in compile_stats(target).compiles}
    assert 4 in widths and max(widths) == 4  # [pending, 3 drafts]; the prefill (10 wide) stayed eager


@torch.no_grad()
def test_a_guard_that_fails_raises_instead_of_recompiling():
    """A compiled step that meets other inputs than it was compiled for (here: a position buffer swapped for one of
    another dtype) raises RecompileError naming the graph; it neither recompiles nor runs eagerly."""
    torch._dynamo.reset()
    target = tiny_target("llama")
    ids, mask = _batch([5, 3], 0)
    target_generate(target, ids, mask, max_new_tokens=4, cache=COMPILED)
    (slot,) = decoding_of(target).slots
    (graph,) = slot.graphs.values()
    graph.positions = graph.positions.int()  # same values and shape, another dtype
    with pytest.raises(RecompileError, match="would recompile graph batch2_width1"):
        target_generate(target, ids, mask, max_new_tokens=4, cache=COMPILED)
    assert compile_stats(target).recompiles == 0


@torch.no_grad()
def test_a_new_model_compiles_its_own_graphs_and_a_dropped_one_is_freed():
    """A second model (a later stage's) compiles its own graphs rather than finding its code objects spent, its
    stats are its own, and a model that is dropped (or released) takes its graphs and caches with it."""
    torch._dynamo.reset()
    ids, mask = _batch([6, 4, 2], 1)
    first = tiny_target("llama", seed=0)
    target_generate(first, ids, mask, max_new_tokens=4, cache=COMPILED)
    second = tiny_target("llama", seed=3)
    rollout = target_generate(second, ids, mask, max_new_tokens=4, cache=COMPILED)
    assert torch.equal(rollout.sequences, target_generate(second, ids, mask, max_new_tokens=4).sequences)
    assert compile_stats(first).compiles == compile_stats(second).compiles == {"batch4_width1_len256": 1}
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    release(second)  # dropped on request: the next compiled decoding starts from nothing, compiling once again
    assert compile_stats(second).total_compiles == 0
    target_generate(second, ids, mask, max_new_tokens=2, cache=COMPILED)
    assert compile_stats(second).compiles == {"batch4_width1_len256": 1}


@torch.no_grad()
def test_the_run_length_is_fixed_and_grows_only_for_a_longer_call():
    """Calls of several lengths share the first call's cache length (rounded up to 256); a call that needs more
    doubles it once; a caller's max_length is kept, and a call it cannot hold is refused by name."""
    torch._dynamo.reset()
    model = tiny_target("llama")
    ids, mask = _batch([6, 4], 2)

    def prefilled(mode: CacheMode, need: int) -> BatchKV:
        kv = mode.factory(need)(model)
        kv.prefill(ids, mask)
        return kv

    lengths = [prefilled(COMPILED, need).max_length for need in (20, 200, 256, 40, 300, 30)]
    assert lengths == [256, 256, 256, 256, 512, 512]
    assert compile_stats(model).cache_lengths == [256, 512]
    fixed = CacheMode(compile=True, backend="eager", max_length=100)
    other = tiny_target("llama", seed=2)
    kv = fixed.factory(30)(other)
    kv.prefill(ids, mask)
    assert kv.max_length == 100 and compile_stats(other).cache_lengths == [100]
    with pytest.raises(ValueError, match="max_length=100. is shorter than this call needs"):
        fixed.factory(101)(tiny_target("llama", seed=4)).prefill(ids, mask)


class _Widths:
    """Records the key columns each attention layer's cache update hands back."""

    def __init__(self, monkeypatch, cls):
        self.widths = []
        update = cls.update

        def recorded(layer, *args, **kwargs):
            keys, values = update(layer, *args, **kwargs)
            self.widths.append(keys.shape[-2])
            return keys, values

        monkeypatch.setattr(cls, "update", recorded)


@torch.no_grad()
def test_a_static_cache_hands_attention_the_columns_a_growing_cache_does(monkeypatch):
    """Eager static caches attend to the used columns only: every forward of a speculative decoding (prefill,
    drafts, verifications, with holes and compactions) sees no more key columns than on growing caches (fewer once
    the static cache, sized to the call, compacts its holes to make room where a growing cache just grows)."""
    from transformers.cache_utils import DynamicLayer

    target = tiny_target("llama")
    drafter = LMDrafter(_perturbed(target, 0.1))
    ids, mask = _batch([11, 6, 3], 0)
    growing, static = _Widths(monkeypatch, DynamicLayer), _Widths(monkeypatch, ColumnLayer)
    a = speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=16)
    b = speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=16, cache=CacheMode(static=True))
    assert torch.equal(a.sequences, b.sequences)
    assert len(static.widths) == len(growing.widths) > 20
    assert all(s <= g for s, g in zip(static.widths, growing.widths))
    assert static.widths[:40] == growing.widths[:40]  # before the first compaction: the same columns


def test_column_layer_rolls_back_and_overflows_by_name():
    layer = ColumnLayer(8)
    k = torch.randn(2, 1, 3, 4)
    keys, _ = layer.update(k, k)
    assert keys.shape == (2, 1, 3, 4) and torch.equal(keys, k)
    layer.crop(-2)  # transformers' rollback protocol: drop the last 2 columns
    keys, _ = layer.update(k, k)
    assert keys.shape[-2] == 4 and torch.equal(keys[:, :, 1:], k)
    assert layer.get_seq_length() == 4 and layer.get_mask_sizes(2) == (6, 0)
    with pytest.raises(ValueError, match="static KV cache of 8 columns overflows"):
        layer.update(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))


def test_compiled_steps_refuse_kwargs_outside_their_fixed_set():
    torch._dynamo.reset()
    model = tiny_target("llama")
    ids, mask = _batch([4, 2], 0)
    kv = COMPILED.factory(30)(model)
    kv.prefill(ids, mask)
    with pytest.raises(ValueError, match="fixed kwarg set.*logits_to_keep"):
        kv.step(ids[:, -1:], logits_to_keep=1)
    assert isinstance(kv, BatchKV)


@torch.no_grad()
def test_compiled_token_trees_pad_to_width_buckets_and_keep_the_eager_tokens(no_recompiles):
    """Tree steps (target verification of N+1 nodes, the draft's beams per depth) run at power-of-two widths with
    padding slots dropped after the forward: greedy output stays the target's, every width is a power of two."""
    from specdistill.decoding import TreeShape

    target = tiny_target("llama")
    drafter = LMDrafter(_perturbed(target, 0.1))
    ids, mask = _batch([9, 5, 3], 0)
    reference = target_generate(target, ids, mask, max_new_tokens=6)
    for _ in range(2):
        rollout = speculative_generate(target, drafter, ids, mask, strategy=TreeShape(topk=2, depth=2, nodes=4),
                                       max_new_tokens=6, cache=COMPILED)
        assert torch.equal(rollout.sequences, reference.sequences)
    for model in (target, drafter.model):
        stats = compile_stats(model)
        assert set(stats.compiles.values()) == {1}, stats.compiles
        tree_widths = [int(name.split("_")[1].removeprefix("width")) for name in stats.compiles if "_tail" in name]
        assert all(w & (w - 1) == 0 for w in tree_widths)
    assert any("_tail" in name for name in compile_stats(target).compiles)


@torch.no_grad()
def test_compiled_sliding_window_layers_keep_the_eager_tokens(no_recompiles):
    """Gemma-3 (sliding and full layers: a 4D mask per layer type in the graph's inputs, windows moving past rejected
    drafts) decodes compiled as it does eagerly."""
    from tests.decoding.test_architectures import MAX_NEW as LONG, NOISE

    target = tiny_target("gemma3", attn_implementation="sdpa")
    ids, mask = _batch([11, 6, 3], 0)
    reference = target_generate(target, ids, mask, max_new_tokens=LONG)
    drafter = LMDrafter(_perturbed(target, NOISE["gemma3"]))
    rollout = speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=LONG, cache=COMPILED)
    assert torch.equal(rollout.sequences, reference.sequences)
    assert set(compile_stats(target).compiles.values()) == {1}


@torch.no_grad()
def test_compiled_hidden_states_are_copied_when_read_and_refused_once_stale():
    """A compiled step's hidden states equal the eager step's layer by layer, are copied only when read, and a layer
    first read after another compiled step ran raises (CUDA graphs may have reused the memory) instead of returning
    the newer step's states."""
    torch._dynamo.reset()
    model = tiny_target("llama")
    ids, mask = _batch([6, 3], 0)
    kvs = [COMPILED.factory(30)(model), BatchKV(model)]
    for kv in kvs:
        kv.prefill(ids[:, :-1], mask[:, :-1])
    compiled, eager = (kv.step(ids[:, -1:], output_hidden_states=True) for kv in kvs)
    assert len(compiled.hidden_states) == len(eager.hidden_states) == model.config.num_hidden_layers + 1
    assert compiled.hidden_states._copies == {}  # nothing copied until read
    torch.testing.assert_close(compiled.hidden_states[-1], eager.hidden_states[-1])
    assert list(compiled.hidden_states._copies) == [model.config.num_hidden_layers]
    kvs[0].step(ids[:, -1:], output_hidden_states=True)
    torch.testing.assert_close(compiled.hidden_states[-1], eager.hidden_states[-1])  # copied before: still its own
    with pytest.raises(RuntimeError, match="read after a compiled graph ran again"):
        compiled.hidden_states[0]
