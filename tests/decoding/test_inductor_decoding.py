"""Compiled decoding with inductor's own kernels (C++ on this CPU, the code generation a GPU's Triton kernels share
their graph lowering with): the tokens of the eager growing cache, each graph compiled once.

The other compiled-decoding tests trace with backend="eager" (dynamo's guards without kernel builds); this one builds
the kernels, so a decode step that dynamo traces but inductor cannot lower (an in-place cache write, the grouped
attention, the fixed-shape masks) fails here rather than first on a GPU. Slow: inductor builds take seconds a graph."""

import copy

import pytest
import torch

from specdistill.decoding import CacheMode, LMDrafter, compile_stats, speculative_generate, target_generate
from specdistill.models.attention import GROUPED_SDPA, use_grouped_sdpa
from tests.conftest import left_padded_prompts
from tests.decoding.test_architectures import _perturbed
from tests.tiny_archs import tiny_target

MAX_NEW = 8


@pytest.mark.slow
@torch.no_grad()
def test_inductor_kernels_decode_the_eager_tokens():
    """A grouped-query target on inductor's kernels: target-only decoding with the features captured (as regeneration
    runs it) and speculative decoding with an LM draft (verify widths, rejected drafts) give the eager growing cache's
    tokens and features in fp32; a second call compiles nothing."""
    torch._dynamo.reset()
    reference = tiny_target("llama", attn_implementation="sdpa")
    target = copy.deepcopy(reference)
    assert use_grouped_sdpa(target) and target.config._attn_implementation == GROUPED_SDPA
    drafter = LMDrafter(_perturbed(reference, 0.1))
    ids, mask = left_padded_prompts([9, 4, 6], seed=2, vocab=320)
    inductor = CacheMode(compile=True, backend="inductor")

    eager = target_generate(reference, ids, mask, max_new_tokens=MAX_NEW, capture_layers=[0, 1])
    for _ in range(2):
        run = target_generate(target, ids, mask, max_new_tokens=MAX_NEW, capture_layers=[0, 1], cache=inductor)
        assert torch.equal(run.sequences, eager.sequences)
        assert torch.allclose(run.hidden, eager.hidden, atol=1e-4, rtol=1e-4)
        spec = speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=MAX_NEW, cache=inductor)
        assert torch.equal(spec.sequences, target_generate(reference, ids, mask, max_new_tokens=MAX_NEW).sequences)
    assert any(bool(((r.num_accepted < r.gamma) & r.active).any()) for r in spec.rounds)  # drafts were rejected
    for model in (target, drafter.model):
        stats = compile_stats(model)
        assert stats.backend == "inductor" and stats.compiles and set(stats.compiles.values()) == {1}, stats.compiles
        assert stats.total_calls > stats.total_compiles


@pytest.mark.slow
@torch.no_grad()
def test_inductor_kernels_run_the_eagle3_head_draft_steps():
    """An EAGLE-3 head's compiled steps on inductor's kernels (one-token draft steps and the padded pending block, its
    fixed cache written at a device column, attention over every column, masked): the eager head's drafts round for
    round, the target's tokens, each graph compiled once."""
    from specdistill.drafts.eagle3 import Eagle3Drafter
    from tests.conftest import make_tiny_lm, noisy_eagle3_head

    torch._dynamo.reset()
    target = make_tiny_lm(48, layers=4, hidden=32, seed=0).eval()
    target.lm_head.weight.data.mul_(4.0)
    head = noisy_eagle3_head(target, 32, 0).eval()
    ids, mask = left_padded_prompts([9, 4, 6], seed=0, vocab=48)
    eager = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=MAX_NEW * 2)
    for _ in range(2):
        run = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=MAX_NEW * 2,
                                   cache=CacheMode(compile=True, backend="inductor"))
        assert torch.equal(run.sequences, eager.sequences)
        assert [r.num_accepted.tolist() for r in run.rounds] == [r.num_accepted.tolist() for r in eager.rounds]
    stats = compile_stats(head)
    assert stats.backend == "inductor" and set(stats.compiles.values()) == {1} and stats.total_calls > 10
    assert {name.split("_")[0] for name in stats.compiles} == {"draft", "pending"}
