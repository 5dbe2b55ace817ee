"""A call's counters (Rollout.target_forwards, accept_hist, position_*) are its rounds' sums, whichever way they are
added: runs of rounds of one shape at once at the end of the call, or round by round; and target-only decoding counts
one forward per emitted token."""

import pytest
import torch

from specdistill.decoding import DynamicGamma, LMDrafter, TreeShape, speculative_generate, target_generate
from specdistill.decoding.generate import _count_rounds, _counters
from tests.conftest import left_padded_prompts
from tests.decoding.test_architectures import _perturbed
from tests.tiny_archs import tiny_target

CASES = {
    "fixed gamma": dict(strategy=3),
    "dynamic gamma": dict(strategy=DynamicGamma(1, 5, 3)),
    "sampled, rows dropped as they stop": dict(strategy=3, temperature=1.0, drop_finished_rows=True, eos_token_id=5),
    "token tree": dict(strategy=TreeShape(topk=2, depth=3)),
}


@torch.no_grad()
@pytest.mark.parametrize("case", list(CASES))
def test_counters_are_the_sums_of_the_rounds(case):
    target = tiny_target("llama")
    drafter = LMDrafter(_perturbed(target, 0.2))
    ids, mask = left_padded_prompts([9, 5, 3, 7], seed=1)
    kwargs = CASES[case]
    gen = torch.Generator().manual_seed(0) if kwargs.get("temperature") else None
    r = speculative_generate(target, drafter, ids, mask, max_new_tokens=20, generator=gen, **kwargs)
    max_depth = r.position_proposed.shape[0]
    one_by_one = _counters(ids.shape[0], max_depth, ids.device)
    for rnd in r.rounds:
        _count_rounds(one_by_one, [rnd])
    for name, value in one_by_one.items():
        torch.testing.assert_close(getattr(r, name), value, msg=f"{case}: {name}")
    assert int(r.accept_hist.sum()) == int(r.target_forwards.sum()) == sum(int(x.active.sum()) for x in r.rounds)
    assert int(r.position_accepted.sum()) == sum(int(x.num_accepted.sum()) for x in r.rounds)


@torch.no_grad()
def test_target_only_decoding_counts_one_forward_per_emitted_token():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts([9, 5, 3], seed=2)
    eos = int(target_generate(target, ids, mask, max_new_tokens=16).sequences[0, 4])  # row 0 stops at its 5th token
    r = target_generate(target, ids, mask, max_new_tokens=16, eos_token_id=eos)
    assert int(r.num_new_tokens[0]) <= 5 and int(r.num_new_tokens.max()) > 5
    assert torch.equal(r.target_forwards, r.num_new_tokens)
    assert r.accept_hist.tolist() == [int(r.num_new_tokens.sum())]
