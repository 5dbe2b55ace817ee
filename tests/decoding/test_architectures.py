"""Every architecture of the tiny-model matrix decodes losslessly: greedy speculative output equals target-only output
(gamma 1..5, a batch of left-padded prompts, drafts that are accepted and rejected), and target-only equals HF generate.

Sliding windows are 6 tokens (tests.tiny_archs) against prompts of 3..11 tokens plus 20 generated ones, so every
row's window moves past rejected drafts several times. Layer types the rollback cannot handle are refused by name.
"""

import copy

import pytest
import torch
import transformers

from specdistill.decoding import LMDrafter, speculative_generate, target_generate
from specdistill.decoding.kv import BatchKV
from tests.conftest import left_padded_prompts
from tests.tiny_archs import ARCHITECTURES, SLIDING_ARCHITECTURES, tiny_target

MAX_NEW = 20
EOS = 2  # the tiny configs' eos_token_id, which HF generate stops at
CASES = [(arch, "sdpa") for arch in ARCHITECTURES] + [("gemma3", "eager")]  # eager: float masks instead of bool


def _prompts(vocab: int = 320) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (3, 11) prompts of 11, 6 and 3 tokens, seeded."""
    return left_padded_prompts([11, 6, 3], vocab=vocab)


def _perturbed(model: torch.nn.Module, noise: float, seed: int = 1) -> torch.nn.Module:
    """A draft that agrees with the target on some tokens only: its weights plus noise relative to each tensor's std."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp(min=1e-3))
    return draft


# Gemma-3's scaled embeddings make its tiny model robust to noise: it needs more to reject a fair share of drafts.
NOISE = {"gemma3": 0.3}


@torch.no_grad()
@pytest.mark.parametrize("arch, attn", CASES)
def test_greedy_speculative_equals_target_only(arch, attn):
    target = tiny_target(arch, attn_implementation=attn)
    drafter = LMDrafter(_perturbed(target, NOISE.get(arch, 0.1)))  # an LM draft of the same arch: same BatchKV path
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    accepted = rejected = 0
    for gamma in range(1, 6):
        r = speculative_generate(target, drafter, ids, mask, strategy=gamma, max_new_tokens=MAX_NEW)
        assert torch.equal(r.sequences, reference.sequences), f"{arch} gamma={gamma}"
        for rnd in r.rounds:
            accepted += int(rnd.num_accepted.sum())
            rejected += int(((rnd.num_accepted < rnd.gamma) & rnd.active).sum())
    assert accepted > 20 and rejected > 20, f"{arch}: {accepted} accepted drafts, {rejected} rejections"


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_target_only_equals_hf_generate(arch):
    """The external reference: transformers' own generate and cache classes on the same left-padded batch (left
    padding only, no holes, so its column-counted sliding windows agree with our position-counted ones)."""
    target = tiny_target(arch)
    ids, mask = _prompts()
    ours = target_generate(target, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=EOS)
    hf = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW,
                         eos_token_id=EOS, pad_token_id=0)[:, ids.shape[1]:]
    for b in range(len(ids)):
        assert ours.tokens(b) == hf[b, : len(ours.tokens(b))].tolist(), f"{arch} row {b}"
        assert len(ours.tokens(b)) == MAX_NEW or ours.tokens(b)[-1] == EOS


@torch.no_grad()
@pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES)
def test_the_window_shapes_these_generations(arch):
    """Guards the tests above: with the window as wide as the context, the same weights generate other tokens."""
    ids, mask = _prompts()
    windowed = target_generate(tiny_target(arch), ids, mask, max_new_tokens=MAX_NEW)
    wide = target_generate(tiny_target(arch, sliding_window=64), ids, mask, max_new_tokens=MAX_NEW)
    assert not torch.equal(windowed.sequences, wide.sequences)


@torch.no_grad()
def test_sampling_with_a_sliding_window_follows_the_target(chi_square_pvalue, first_three_marginals,
                                                          interleaved_prompts):
    """T=1, window 3 shorter than every prompt, three prompt lengths in one left-padded batch and ragged acceptance
    (holes): each row's first three tokens follow the target's exact marginals on its unpadded prompt."""
    V, N = 16, 1500
    target = tiny_target("mistral", vocab_size=V, sliding_window=3)
    draft = _perturbed(target, 0.3)
    prompts = [[3, 9, 4, 9, 4], [7, 2, 5, 8], [5, 11, 6, 8, 13, 10]]
    K = len(prompts)
    ids, mask = interleaved_prompts(prompts, N)
    out = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=2, max_new_tokens=3, temperature=1.0,
                               generator=torch.Generator().manual_seed(0))
    assert 0.1 < out.acceptance_per_position[0] < 0.9
    for k, prompt in enumerate(prompts):
        rows = out.sequences[k::K]                                                          # (N, 3)
        for i, p in enumerate(first_three_marginals(target, prompt, V)):
            counts = torch.bincount(rows[:, i], minlength=V)
            assert chi_square_pvalue(counts, p) > 1e-3, f"prompt of {len(prompt)} tokens, token {i}"


_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)
_UNSUPPORTED = {  # model class -> (config class, fields), each with one layer type the rollback cannot handle
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", dict(
        layer_types=["linear_attention", "full_attention"], num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)),
    "Llama4ForCausalLM": ("Llama4TextConfig", dict(attention_chunk_size=4, num_local_experts=2,
                                                   intermediate_size_mlp=64)),
}


@pytest.mark.parametrize("model_cls, layer_type", [("Qwen3NextForCausalLM", "linear_attention"),
                                                   ("Llama4ForCausalLM", "chunked_attention")])
def test_unsupported_layer_types_are_refused_by_name(model_cls, layer_type):
    config_cls, fields = _UNSUPPORTED[model_cls]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**_SMALL, **fields))
    with pytest.raises(ValueError, match=f"{model_cls} has '{layer_type}' layers"):
        BatchKV(model)
    with pytest.raises(ValueError, match=layer_type):
        LMDrafter(model).start(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))


def test_sliding_layers_with_a_column_windowing_kernel_are_refused():
    model = tiny_target("mistral")
    model.config._attn_implementation = "flash_attention_2"  # set, not loaded: the kernel need not be installed
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*sdpa"):
        BatchKV(model)
