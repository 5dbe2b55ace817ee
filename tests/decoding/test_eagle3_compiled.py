"""The EAGLE-3 head's compiled steps (eval.compile: drafts/eagle3/compiled.py: one-token draft steps and the padded
pending block) draft what its eager steps draft, compile each graph once, and keep their fixed cache within its
columns along long outputs.

Traced with dynamo's eager backend (its guards and recompiles, no kernel builds); inductor's kernels:
test_inductor_decoding.py."""

import pytest
import torch

from specdistill.decoding import CacheMode, compile_stats, speculative_generate, target_generate
from specdistill.decoding.compiled import release
from specdistill.drafts.eagle3 import Eagle3Drafter
from tests.conftest import left_padded_prompts, make_tiny_lm, noisy_eagle3_head

V = 48
COMPILED = CacheMode(compile=True, backend="eager")


@pytest.fixture
def no_recompiles():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def _models(seed=0):
    target = make_tiny_lm(V, layers=4, hidden=32, seed=seed).eval()
    target.lm_head.weight.data.mul_(4.0)  # peaked distributions: drafts get accepted and rejected
    return target, noisy_eagle3_head(target, 32, seed).eval()


def _same_rounds(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.num_new_tokens, b.num_new_tokens)
    assert len(a.rounds) == len(b.rounds)
    for ra, rb in zip(a.rounds, b.rounds):  # the same drafts accepted, round by round
        assert torch.equal(ra.num_accepted, rb.num_accepted) and torch.equal(ra.draft_tokens, rb.draft_tokens)
        assert torch.allclose(ra.alpha, rb.alpha, atol=1e-5)  # the draft's distribution q, through min(p, q)


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_draft_steps_draft_what_the_eager_steps_draft(no_recompiles, temperature):
    """Greedy and sampled (same generator seed), over ragged prompts: the same drafts, acceptances and tokens as the
    eager head; its one-token draft graph compiled once per bucket and replayed every later step."""
    target, head = _models()
    drafter = Eagle3Drafter(head)
    for seed, lengths in enumerate([[9, 4, 6], [3, 8, 5, 7]]):  # one bucket (4)
        ids, mask = left_padded_prompts(lengths, seed=seed, vocab=V)

        eager, compiled = (speculative_generate(target, drafter, ids, mask, strategy=4, max_new_tokens=24,
                                                temperature=temperature, generator=torch.Generator().manual_seed(seed),
                                                record=True, cache=cache) for cache in (CacheMode(), COMPILED))
        _same_rounds(eager, compiled)
    assert any(bool((r.num_accepted < r.gamma).any()) for r in compiled.rounds)       # rejections
    assert any(bool((r.num_accepted > 0).any()) for r in compiled.rounds)             # and acceptances
    stats = compile_stats(head)  # the one-token step and the padded pending block, one graph each
    assert stats.backend == "eager" and stats.compiles == {"draft_batch4_width1_hidden_len256": 1,
                                                           "pending_batch4_width5_hidden_len256": 1}, stats.compiles
    assert stats.calls["draft_batch4_width1_hidden_len256"] > 20  # replayed: rounds of 3 one-token steps, 2 calls
    assert stats.as_dict()["by_bucket"] == {"4": 2}  # what the evaluator and gpu_check report
    assert drafter.slot is None  # freed as the call ended


@torch.no_grad()
def test_compiled_head_keeps_its_rows_where_rows_stop_early(no_recompiles):
    """With drop_finished_rows a stopped row leaves growing caches; the compiled head's fixed cache keeps its rows
    (the call decides so at its start), and the tokens stay the eager decoding's."""
    target, head = _models()
    ids, mask = left_padded_prompts([9, 4, 6], seed=0, vocab=V)
    first = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=24)
    eos = int(first.sequences[0, 3])  # row 0 stops after 4 tokens, the others later or at their budget
    eager = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=24,
                                 eos_token_id=eos, drop_finished_rows=True)
    assert any(r.rows is not None for r in eager.rounds)  # growing caches dropped the stopped row
    compiled = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=24,
                                    eos_token_id=eos, drop_finished_rows=True, cache=COMPILED)
    assert all(r.rows is None for r in compiled.rounds)
    assert torch.equal(compiled.sequences, eager.sequences)


@torch.no_grad()
def test_compiled_head_reuses_its_graph_across_calls_and_batch_sizes(no_recompiles):
    """Batches of 1..4 rows with other prompt lengths after warm-up on buckets 4, 2 and 1 compile nothing more; a
    target-only decoding between them leaves the head's graphs alone."""
    target, head = _models(1)
    drafter = Eagle3Drafter(head)
    for lengths in ([7, 3, 5], [6, 2], [5]):
        speculative_generate(target, drafter, *left_padded_prompts(lengths, seed=0, vocab=V), strategy=3,
                             max_new_tokens=10, cache=COMPILED)
    warm = dict(compile_stats(head).compiles)
    assert {name.split("_")[1] for name in warm} == {"batch4", "batch2", "batch1"} and set(warm.values()) == {1}
    for seed, lengths in enumerate([[4, 9, 2, 6], [8], [3, 3], [10, 2, 5]]):
        ids, mask = left_padded_prompts(lengths, seed=seed + 5, vocab=V)
        target_generate(target, ids, mask, max_new_tokens=4, cache=COMPILED)
        r = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=3, max_new_tokens=10,
                                 cache=COMPILED)
        assert torch.equal(r.sequences, target_generate(target, ids, mask, max_new_tokens=10).sequences)
    assert compile_stats(head).compiles == warm
    release(head)
    assert compile_stats(head).total_compiles == 0


@torch.no_grad()
def test_compiled_head_cache_compacts_in_place_along_a_long_output():
    """A near-uniform target and a softened head, drafts sampled at T=1: most drafts are accepted and rows accept
    different counts, leaving holes in the head's cache; its fixed buffers compact in place (one run length), and the
    drafts stay the eager head's round for round."""
    torch._dynamo.reset()
    target = make_tiny_lm(V, layers=4, hidden=32, seed=0).eval()
    head = noisy_eagle3_head(target, V, 0).eval()
    head.lm_head.weight.data.mul_(0.3)
    ids, mask = left_padded_prompts([14, 5, 1, 9], seed=1)
    compacted = []

    class Counted(Eagle3Drafter):
        def _compact(self, widest):
            compacted.append(self.mask.shape[1] - widest)
            super()._compact(widest)

    def run(cache):
        return speculative_generate(target, Counted(head), ids, mask, strategy=5, max_new_tokens=160, temperature=1.0,
                                    generator=torch.Generator().manual_seed(0), draft_policy="sample", record=True,
                                    cache=cache)

    eager = run(CacheMode())
    n_eager = len(compacted)
    compiled = run(COMPILED)
    _same_rounds(eager, compiled)
    assert n_eager >= 1 and len(compacted) == 2 * n_eager  # the same compactions, eager and compiled
    assert len(compile_stats(head).cache_lengths) == 1


@torch.no_grad()
def test_token_trees_on_the_compiled_head_cache_stay_eager_and_exact(no_recompiles):
    """Token trees draft eagerly on the head's fixed cache (their widths vary): the eager head's tokens and accepted
    paths, and no head graph compiled."""
    from specdistill.decoding import TreeShape

    target, head = _models()
    ids, mask = left_padded_prompts([9, 4, 6], seed=0, vocab=V)
    shape = TreeShape(topk=2, depth=3, nodes=6)
    eager = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=shape, max_new_tokens=20)
    compiled = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=shape, max_new_tokens=20,
                                    cache=COMPILED)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert [r.num_accepted.tolist() for r in compiled.rounds] == [r.num_accepted.tolist() for r in eager.rounds]
    assert compile_stats(head).total_compiles == 0


@torch.no_grad()
def test_compiled_head_under_autocast_keeps_the_eager_steps_dtypes(no_recompiles):
    """An fp32 head beside its target under bf16 autocast (Draft-OPD's rollouts, spec-eval): the features come in
    bf16, and a compiled step keeps its residual stream in bf16 as the eager step does (its graph is the features'
    dtype's); outputs agree up to bf16 rounding (exact drafts are not: a bf16 sum over other columns rounds
    otherwise), and a decoding runs on that path."""
    from specdistill.drafts.eagle3.compiled import compiled_head
    from specdistill.drafts.eagle3.model import SlotCache

    target, head = _models()
    c = head.config
    B, S = 3, 7
    torch.manual_seed(0)
    tokens = torch.randint(0, V, (B, 1))
    keys, values = torch.randn(B, c.num_attention_heads, S, c.head_dim), torch.randn(B, c.num_attention_heads, S,
                                                                                      c.head_dim)
    visible = torch.rand(B, S + 1) > 0.3
    visible[:, -1] = True
    compiled = compiled_head(head, "eager")
    owner = Eagle3Drafter(head)  # what holds the slot
    slot = compiled.acquire(owner, B, 64)
    eager_cache = SlotCache(B, c.num_attention_heads, c.head_dim, "cpu", torch.float32, capacity=16)
    for cache in (slot.cache, eager_cache):
        cache.append(keys, values)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g16 = head.fc(torch.randn(B, 1, head.fc.in_features))  # features as the drafter makes them: bf16
        eager = head.step(tokens, g16, torch.full((B, 1), S), eager_cache, visible)
        h, logits = compiled.run(slot, tokens, g16, torch.full((B, 1), S), visible, torch.zeros(B).long())
    assert g16.dtype == eager.hidden.dtype == h.dtype == torch.bfloat16
    torch.testing.assert_close(h.float(), eager.hidden.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(logits.float(), eager.logits[:, 0].float(), atol=0.05, rtol=0.02)
    assert list(compile_stats(head).compiles) == ["draft_batch4_width1_hidden_len256_bfloat16"]
    ids, mask = left_padded_prompts([9, 4, 6], seed=0, vocab=V)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=12,
                                 cache=COMPILED)
    assert r.num_new_tokens.tolist() == [12, 12, 12]  # the compiled path decodes under autocast


@torch.no_grad()
def test_a_dropped_drafter_frees_its_compiled_slot():
    """A drafter started but never closed (a timing helper, an exception) frees its slot when it is garbage
    collected: the next call reuses the slot and its graphs instead of compiling a second set."""
    import gc

    torch._dynamo.reset()
    target, head = _models()
    ids, mask = left_padded_prompts([9, 4, 6], seed=0, vocab=V)
    speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=12, cache=COMPILED)
    compiled = compile_stats(head).compiles.copy()
    drafter = Eagle3Drafter(head)
    drafter.start(ids, mask, target_hidden=target(ids, output_hidden_states=True).hidden_states,
                  new_kv=COMPILED.factory(40))
    assert drafter.slot.busy
    slot = drafter.slot
    del drafter
    gc.collect()
    assert not slot.busy
    speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=12, cache=COMPILED)
    assert compile_stats(head).compiles == compiled
