"""Compiled decoding keeps CUDA graphs' rules (tests/graph_pool.py, on the CPU): it reads no graph output after a later
graph ran, and every input a graph writes in place has a fixed address. Each decoding here runs with outputs
poisoned at the next graph's start and must decode what the eager growing caches decode: target-only, LM drafts,
EAGLE-3 heads (greedy and sampled, the features rollouts keep), token trees, the oracle, and Draft-OPD rollouts."""

import pytest
import torch

from specdistill.decoding import CacheMode, LMDrafter, TreeShape, speculative_generate, target_generate
from specdistill.decoding.drafters import OracleDrafter
from specdistill.drafts.eagle3 import Eagle3Drafter
from specdistill.onpolicy.rollout import collect_rollout
from tests.conftest import left_padded_prompts, make_tiny_lm, noisy_eagle3_head
from tests.decoding.test_architectures import _perturbed
from tests.graph_pool import register
from tests.tiny_archs import tiny_target

POOL = CacheMode(compile=True, backend=register())
EAGER = CacheMode()
V = 48


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _sampled(seed: int) -> dict:
    return dict(temperature=1.0, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_the_backend_poisons_stale_outputs_and_refuses_writes_into_inputs_without_a_fixed_address():
    """The rules are enforced: an output held past the next graph reads NaN, and a graph that writes into an input
    without a fixed address raises."""
    def step(x, buf):
        return x * 2

    f = torch.compile(step, backend=POOL.backend, fullgraph=True)
    x, buf = torch.ones(3), torch.zeros(3)
    first = f(x, buf)
    assert torch.equal(first, torch.full((3,), 2.0))
    f(x + 1, buf)
    assert torch.isnan(first).all()

    def writes(x, buf):
        buf.add_(x)
        return x + 1

    with pytest.raises(Exception, match="without a fixed address"):
        torch.compile(writes, backend=POOL.backend, fullgraph=True)(x, torch.zeros(3))
    fixed = torch.zeros(3)
    torch._dynamo.mark_static_address(fixed)
    torch.compile(writes, backend=POOL.backend, fullgraph=True)(x, fixed)
    assert torch.equal(fixed, x)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # masks built in the graph; ready-built sliding masks
def test_target_only_and_lm_draft_decoding(arch):
    target = tiny_target(arch)
    drafter = LMDrafter(_perturbed(target, 0.1))
    for seed, lengths in enumerate([[11, 6, 3], [7]]):  # buckets 4 and 1
        ids, mask = left_padded_prompts(lengths, seed=seed, vocab=320)
        reference = target_generate(target, ids, mask, max_new_tokens=10, cache=EAGER).sequences
        assert torch.equal(target_generate(target, ids, mask, max_new_tokens=10, cache=POOL).sequences, reference)
        spec = speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=10, cache=POOL)
        assert torch.equal(spec.sequences, reference), lengths
        sampled = [speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=10, cache=cache,
                                        **_sampled(seed)).sequences for cache in (EAGER, POOL)]
        assert torch.equal(*sampled)


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eagle3_head_rounds_and_kept_features(temperature):
    """The compiled head's rounds (its draft steps feed each other their outputs) and the target features a rollout
    keeps (read from the verify graph's hidden states) are the eager path's."""
    target = make_tiny_lm(V, layers=4, hidden=32, seed=0).eval()
    target.lm_head.weight.data.mul_(4.0)
    head = noisy_eagle3_head(target, 32, 0).eval()
    aux = list(head.config.aux_layer_ids)
    for seed, lengths in enumerate([[9, 4, 6], [3, 8]]):
        ids, mask = left_padded_prompts(lengths, seed=seed, vocab=V)
        eager, pooled = (speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=4, max_new_tokens=24,
                                              temperature=temperature, generator=torch.Generator().manual_seed(seed),
                                              draft_policy="sample", record=True, capture_layers=aux, cache=cache)
                         for cache in (EAGER, POOL))
        assert torch.equal(eager.sequences, pooled.sequences)
        for a, b in zip(eager.rounds, pooled.rounds):
            assert torch.equal(a.draft_tokens, b.draft_tokens) and torch.equal(a.num_accepted, b.num_accepted)
            assert torch.allclose(a.target_logits, b.target_logits, atol=1e-4)
        assert torch.allclose(eager.hidden, pooled.hidden, atol=1e-4)


@torch.no_grad()
def test_token_trees_and_the_oracle():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts([9, 4, 6], seed=3, vocab=320)
    reference = target_generate(target, ids, mask, max_new_tokens=12, cache=EAGER).sequences
    tree = speculative_generate(target, LMDrafter(_perturbed(target, 0.1)), ids, mask,
                                strategy=TreeShape(topk=2, depth=2), max_new_tokens=12, cache=POOL)
    assert torch.equal(tree.sequences, reference)
    oracle = OracleDrafter(target, 12, cache=POOL)
    oracle.prepare(ids, mask)
    replayed = speculative_generate(target, oracle, ids, mask, strategy=4, max_new_tokens=12, cache=POOL)
    assert torch.equal(replayed.sequences, reference)


@torch.no_grad()
@pytest.mark.parametrize("tree", [None, TreeShape(topk=2, depth=2)])
def test_draft_opd_rollouts(tree):
    target = make_tiny_lm(V, layers=4, hidden=32, seed=0).eval()
    head = noisy_eagle3_head(target, V, 0).eval()
    ids, mask = left_padded_prompts([7, 3, 5], seed=1, vocab=V)
    eager, pooled = (collect_rollout(target, head, ids, mask, gamma=3, max_new_tokens=10, temperature=0.0,
                                     cache=cache, tree=tree) for cache in (None, POOL))
    for name in ("row", "context_len", "token", "accepted"):
        assert torch.equal(getattr(eager, name), getattr(pooled, name)), name
    assert torch.allclose(eager.target.dense(), pooled.target.dense(), atol=1e-4)
    assert torch.allclose(eager.aux, pooled.aux, atol=1e-4)
