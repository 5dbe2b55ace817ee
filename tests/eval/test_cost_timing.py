"""The cost model's draft cost c is the steady-state propose(): the prefill round (an EAGLE-3 head reading the whole
prompt) is timed apart. Checked on a fake clock that only the models move."""

import pytest
import torch

from specdistill.decoding import CacheMode, Drafter, Proposal, Sampler
from specdistill.eval import timing
from specdistill.eval.batches import PromptBatch

TARGET_S = 0.010      # every target forward
PREFILL_S = 1.0       # the first propose() after start()
PER_DRAFT_S = 0.002   # each drafted token of a later propose()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PromptReadingDrafter(Drafter):
    """Costs PREFILL_S on its first propose() after start() (as an EAGLE-3 head that feeds the prompt's slots), then
    PER_DRAFT_S per token once a round was committed."""

    def __init__(self, clock: Clock):
        self.clock, self.fresh, self.commits = clock, True, 0

    def start(self, input_ids, attention_mask, target_hidden=None, new_kv=None):
        self.fresh, self.B = True, input_ids.shape[0]

    def propose(self, shape, sampler):
        k = shape.size
        self.clock.now += PREFILL_S if self.fresh else PER_DRAFT_S * k
        return Proposal(torch.full((self.B, k), 5, dtype=torch.long))

    def commit(self, num_accepted, next_token, active, target_hidden=None, path=None):
        assert int(num_accepted.sum()) == 0 and bool(active.all())
        self.fresh = False
        self.commits += 1


@pytest.mark.parametrize("cache", [CacheMode(), CacheMode(static=True)], ids=["growing", "static"])
def test_the_prefill_propose_is_timed_apart_from_c(target, monkeypatch, request, cache):
    clock = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    hook = target.register_forward_hook(lambda *_: setattr(clock, "now", clock.now + TARGET_S))
    request.addfinalizer(hook.remove)  # the target is shared by the session
    drafter = PromptReadingDrafter(clock)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0                                                           # a left-padded row
    gamma, reps = 4, 5
    cost = timing.measure_cost(target, drafter, PromptBatch(ids * mask, mask, [0, 1]), gamma, Sampler(0.0), reps=reps,
                               cache=cache)
    assert cost.target_step_ms == pytest.approx(1000 * TARGET_S)
    assert cost.draft_token_ms == pytest.approx(1000 * PER_DRAFT_S)           # the steady state only
    assert cost.c == pytest.approx(PER_DRAFT_S / TARGET_S)
    assert cost.draft_prefill_ms == pytest.approx(1000 * PREFILL_S)
    assert drafter.commits == reps + 1                                       # every timed propose follows a commit
