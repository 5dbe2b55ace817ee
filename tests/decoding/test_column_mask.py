"""Compiled chain steps of full-attention models build their 4D masks inside the graph from the columns each row
sees (compiled.column_mask, SeenColumns): the mask is transformers' own (causal AND padding, bool or additive) bit for
bit, the decoded tokens are the eager ones, and models whose masks it cannot reproduce keep ready-built masks."""

import pytest
import torch

from specdistill.decoding import CacheMode, LMDrafter, speculative_generate, target_generate
from specdistill.decoding.compiled import MaskFormat, SeenColumns, column_mask, decoding_of
from tests.decoding.test_architectures import MAX_NEW, _perturbed, _prompts
from tests.tiny_archs import SLIDING_ARCHITECTURES, tiny_target

COMPILED = CacheMode(compile=True, backend="eager")
FULL_ATTENTION = [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"), ("qwen3_moe", "sdpa")]


def _reference(seen: torch.Tensor, write_at: int, width: int) -> torch.Tensor:
    """column_mask's rule written out element by element: (R, 1, width, L) bool."""
    R, L = seen.shape
    out = torch.zeros(R, 1, width, L, dtype=torch.bool)
    for r in range(R):
        for i in range(width):
            for j in range(L):
                out[r, 0, i, j] = bool(seen[r, j]) and j <= write_at + i
    return out


@pytest.mark.parametrize("seed", range(4))
def test_column_mask_is_causal_and_padding_by_column(seed):
    g = torch.Generator().manual_seed(seed)
    R, L, width = 3, 12, int(torch.randint(1, 5, (), generator=g))
    seen = torch.rand(R, L, generator=g) < 0.7
    write_at = int(torch.randint(0, L - width + 1, (), generator=g))
    expected = _reference(seen, write_at, width)
    assert torch.equal(column_mask(seen, torch.tensor(write_at), width), expected)
    additive = column_mask(seen, torch.tensor(write_at), width, torch.float16)
    assert additive.dtype == torch.float16
    assert torch.equal(additive == 0, expected)
    assert torch.all(additive[~expected] == torch.finfo(torch.float16).min)


@torch.no_grad()
@pytest.mark.parametrize("arch, attn", FULL_ATTENTION)
def test_full_attention_chain_steps_build_their_masks_in_the_graph_and_keep_the_eager_tokens(arch, attn):
    """Target-only and speculative decoding (drafts accepted and rejected, so holes) on compiled caches: the masks
    the graphs build are the ones transformers builds (learned once per model, bool for sdpa, additive for eager),
    and the tokens equal the eager growing caches'."""
    torch._dynamo.reset()
    target = tiny_target(arch, attn_implementation=attn)
    draft = _perturbed(target, 0.1)
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    assert torch.equal(target_generate(target, ids, mask, max_new_tokens=MAX_NEW, cache=COMPILED).sequences,
                       reference.sequences)
    r = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=3, max_new_tokens=MAX_NEW, cache=COMPILED)
    assert torch.equal(r.sequences, reference.sequences)
    assert any((rnd.num_accepted < rnd.gamma).any() for rnd in r.rounds)  # rejections left holes
    for model in (target, draft):
        decoding = decoding_of(model)
        assert decoding.mask_format_for == attn and decoding.mask_format is not None
        assert decoding.mask_format.dtype == (torch.bool if attn == "sdpa" else model.dtype)
        graphs = [key for slot in decoding.slots for key in slot.graphs]
        assert graphs and all(key.seen for key in graphs)


@torch.no_grad()
@pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES[:1])
def test_sliding_window_models_keep_ready_built_masks(arch):
    torch._dynamo.reset()
    target = tiny_target(arch, attn_implementation="sdpa")
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    assert torch.equal(target_generate(target, ids, mask, max_new_tokens=MAX_NEW, cache=COMPILED).sequences,
                       reference.sequences)
    decoding = decoding_of(target)
    assert decoding.mask_format_for is None
    assert not any(key.seen for slot in decoding.slots for key in slot.graphs)


def test_a_mask_format_column_mask_cannot_reproduce_is_not_learned():
    """MaskFormat.learn takes a format only where column_mask gives the built mask exactly."""
    seen = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])                  # (B, S) columns in use, the step's own last
    built = column_mask(torch.nn.functional.pad(seen.bool(), (0, 4)), torch.tensor(2), 2)  # (2, 1, 2, 8)
    assert MaskFormat.learn(built, seen, 2) == MaskFormat(torch.bool, None)
    assert MaskFormat.learn({"full_attention": built}, seen, 2) == MaskFormat(torch.bool, ("full_attention",))
    other = built.clone()
    other[0, 0, 1, 1] = False                                           # a rule that is not causal AND padding
    assert MaskFormat.learn(other, seen, 2) is None
    assert MaskFormat.learn({"a": built, "b": other}, seen, 2) is None  # layer types with different masks
    assert MaskFormat.learn(built.expand(2, 4, 2, 8), seen, 2) is None  # per-head masks
    assert MaskFormat.learn(built.long(), seen, 2) is None              # neither bool nor additive
    assert MaskFormat.learn(None, seen, 2) is None                      # masks the model builds itself
    assert isinstance(SeenColumns(seen).seen, torch.Tensor)


@torch.no_grad()
def test_dummy_rows_see_every_column_whatever_an_earlier_call_left():
    """A call of fewer rows in the same bucket: the rows past them (dummy rows, never read) see every column again,
    in the target's and the EAGLE-3 head's seen buffers, rather than a wider call's leftover padding (a dummy row that
    sees nothing would attend over no column at all); the tokens stay the eager ones."""
    from specdistill.drafts.eagle3 import Eagle3Drafter
    from tests.conftest import left_padded_prompts, noisy_eagle3_head

    torch._dynamo.reset()
    target = tiny_target("llama")
    head = noisy_eagle3_head(target, 64)
    wide = left_padded_prompts([30, 30, 30, 2], seed=0)   # row 3: mostly left padding
    narrow = left_padded_prompts([5, 6, 4], seed=1)       # the same bucket (4), row 3 a dummy row
    for ids, mask in (wide, narrow):
        r = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=3, max_new_tokens=8,
                                 cache=COMPILED)
        assert torch.equal(r.sequences, target_generate(target, ids, mask, max_new_tokens=8).sequences)
    for decoding in (decoding_of(target), decoding_of(head)):
        (slot,) = [s for s in decoding.slots if s.bucket == 4]
        buffers = [g.masks for key, g in slot.graphs.items() if key.seen] if decoding is decoding_of(target) else \
            [g.seen for g in slot.graphs.values()]
        assert buffers and all(bool(b[3].all()) for b in buffers)
