"""Grouped-query attention that reads the cache as it is (models/attention.py): the same logits and tokens as
transformers' "sdpa" on every architecture of the tiny matrix (4 query heads over 2 key/value heads), with no key or
value head repeated, on growing, static and compiled caches; every grouped-query model loaded through
load_causal_lm attends with it."""

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from specdistill.decoding import CacheMode, LMDrafter, speculative_generate, target_generate
from specdistill.models.attention import GROUPED_SDPA, use_grouped_sdpa
from specdistill.models.target import load_causal_lm
from tests.decoding.test_architectures import MAX_NEW, NOISE, _perturbed, _prompts
from tests.tiny_archs import ARCHITECTURES, tiny_config, tiny_target


@pytest.fixture
def repeats(monkeypatch):
    """Counts transformers' repeat_kv calls that copy a cache (more than one head per key/value head)."""
    count = {"n": 0}
    original = hf_sdpa.repeat_kv

    def counted(hidden_states, n_rep):
        count["n"] += n_rep > 1
        return original(hidden_states, n_rep)

    monkeypatch.setattr(hf_sdpa, "repeat_kv", counted)
    return count


def _pair(arch: str):
    """The tiny target on transformers' sdpa, and a copy switched to GROUPED_SDPA."""
    reference = tiny_target(arch, attn_implementation="sdpa")
    grouped = copy.deepcopy(reference)
    assert use_grouped_sdpa(grouped), arch
    assert grouped.config._attn_implementation == GROUPED_SDPA
    return reference, grouped


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_verify_forwards_equal_sdpa_without_repeating_the_cache(arch, repeats):
    """Left-padded prompts, then verify-shaped steps of 5 tokens with ragged commits (a row keeps 0..5): the logits
    of every step equal sdpa's, and sdpa repeats the cache where the grouped function does not."""
    from specdistill.decoding.kv import BatchKV

    reference, grouped = _pair(arch)
    ids, mask = _prompts()
    g = torch.Generator().manual_seed(0)
    caches = {}
    for name, model in (("sdpa", reference), ("grouped", grouped)):
        repeats["n"] = 0
        kv = BatchKV(model)
        kv.prefill(ids[:, :-1], mask[:, :-1])
        steps = []
        g.manual_seed(0)
        for _ in range(6):
            fed = torch.randint(3, 320, (ids.shape[0], 5), generator=g)
            steps.append(kv.step(fed).logits)
            keep = torch.arange(5) < torch.randint(0, 6, (ids.shape[0], 1), generator=g)
            kv.commit(keep)
        caches[name] = (steps, repeats["n"])
    for k, (a, b) in enumerate(zip(caches["sdpa"][0], caches["grouped"][0])):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{arch} step {k}")
    assert caches["sdpa"][1] > 0, f"{arch}: sdpa no longer repeats the cache here; the test no longer tells"
    assert caches["grouped"][1] == 0, f"{arch}: the grouped function repeated a key/value head"


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("cache", [CacheMode(), CacheMode(static=True)], ids=["growing", "static"])
def test_grouped_attention_decodes_sdpas_tokens(arch, cache):
    """Greedy target-only and speculative decoding (an LM draft, drafts accepted and rejected) give sdpa's tokens."""
    reference, grouped = _pair(arch)
    ids, mask = _prompts()
    expected = target_generate(reference, ids, mask, max_new_tokens=MAX_NEW).sequences
    assert torch.equal(target_generate(grouped, ids, mask, max_new_tokens=MAX_NEW, cache=cache).sequences, expected)
    drafter = LMDrafter(_perturbed(grouped, NOISE.get(arch, 0.1)))
    r = speculative_generate(grouped, drafter, ids, mask, strategy=4, max_new_tokens=MAX_NEW, cache=cache)
    assert torch.equal(r.sequences, expected), arch
    assert any(bool(((rnd.num_accepted < rnd.gamma) & rnd.active).any()) for rnd in r.rounds)  # rejections happened


@torch.no_grad()
def test_grouped_attention_compiles_once_per_graph():
    """The compiled decode steps trace the grouped function (dynamo's tracer, no inductor build): the tokens of the
    eager path, and a second call compiles nothing."""
    from specdistill.decoding import compile_stats

    torch._dynamo.reset()
    reference, grouped = _pair("llama")
    ids, mask = _prompts()
    expected = target_generate(reference, ids, mask, max_new_tokens=MAX_NEW).sequences
    compiled = CacheMode(compile=True, backend="eager")
    drafter = LMDrafter(_perturbed(reference, 0.1))
    for _ in range(2):
        r = speculative_generate(grouped, drafter, ids, mask, strategy=3, max_new_tokens=MAX_NEW, cache=compiled)
        assert torch.equal(r.sequences, expected)
    stats = compile_stats(grouped)
    assert stats.compiles and all(n == 1 for n in stats.compiles.values()), stats.compiles


@pytest.mark.parametrize("kv_heads, expected", [(2, GROUPED_SDPA), (4, "sdpa")])
def test_load_causal_lm_switches_grouped_query_models(tmp_path, kv_heads, expected):
    """A grouped-query model saved with sdpa loads attending with GROUPED_SDPA; one key/value head per query head
    (nothing to repeat) keeps sdpa. The saved config names no attention function either way."""
    import transformers

    model = transformers.LlamaForCausalLM(tiny_config("llama", num_key_value_heads=kv_heads))
    model.save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path))
    assert loaded.config._attn_implementation == expected
    again = tmp_path / "again"
    loaded.save_pretrained(again)
    assert GROUPED_SDPA not in (again / "config.json").read_text()
