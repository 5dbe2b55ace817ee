"""A decoding call hands its compiled cache back when it ends (back-to-back calls reuse slot 0 and its graphs, compiling
nothing), a closed BatchKV refuses to step, and a speculative round brings values to the host once."""

import os

import pytest
import torch

from specdistill.decoding import CacheMode, LMDrafter, TreeShape, compile_stats, speculative_generate, target_generate
from specdistill.decoding.compiled import decoding_of
from specdistill.drafts.eagle3 import Eagle3Drafter
from tests.conftest import left_padded_prompts, make_tiny_lm, noisy_eagle3_head
from tests.decoding.test_architectures import _perturbed
from tests.tiny_archs import tiny_target

COMPILED = CacheMode(compile=True, backend="eager")
V = 48


def _slots(model) -> list[int]:
    return sorted(slot.index for slot in decoding_of(model).slots)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["target", "chain", "tree"])
def test_back_to_back_calls_reuse_slot_zero_and_compile_nothing(kind, no_gc):
    """The first call's Rollout, drafter (and its BatchKV) stay referenced; the second call of the same bucket runs on
    slot 0's cache and graphs: no `_slot1` graph, no new compile, and the tokens of an eager growing cache."""
    target = tiny_target("llama")
    drafter = LMDrafter(_perturbed(target, 0.1))
    ids, mask = left_padded_prompts([7, 4, 3], seed=0, vocab=320)

    def decode(cache):
        if kind == "target":
            return target_generate(target, ids, mask, max_new_tokens=8, cache=cache)
        if kind == "chain":
            return speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=8, cache=cache)
        return speculative_generate(target, drafter, ids, mask, strategy=TreeShape(topk=2, depth=2), max_new_tokens=8,
                                    cache=cache)

    first = decode(COMPILED)
    held = drafter.kv if kind != "target" else None  # the first call's draft cache, still referenced
    after_first = {m: dict(compile_stats(m).compiles) for m in (target, drafter.model)}
    second = decode(COMPILED)
    for model, compiles in after_first.items():
        assert compile_stats(model).compiles == compiles, f"the second call compiled: {compile_stats(model).compiles}"
        assert not any(name.endswith("_slot1") for name in compile_stats(model).compiles)
    assert _slots(target) == [0] and not any(slot.busy for slot in decoding_of(target).slots)
    assert torch.equal(first.sequences, second.sequences)
    assert torch.equal(second.sequences, decode(CacheMode()).sequences)
    if held is not None:
        assert held.closed and held.slot is None


@torch.no_grad()
def test_a_live_call_takes_a_second_slot_and_a_closed_cache_refuses_to_step(no_gc):
    """Two BatchKVs decoding at once hold two slots; close() frees one for the next prefill (slot 0 again), and a
    closed BatchKV steps only after a new prefill."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts([5, 3], seed=1, vocab=320)
    new_kv = COMPILED.factory(32)
    a, b = new_kv(target), new_kv(target)
    a.prefill(ids, mask)
    b.prefill(ids, mask)
    assert (a.slot.index, b.slot.index) == (0, 1)
    a.close()
    with pytest.raises(ValueError, match="after close"):
        a.step(ids[:, -1:])
    c = new_kv(target)
    c.prefill(ids, mask)
    assert c.slot.index == 0
    with b:
        pass
    assert b.closed and not any(slot.busy for slot in decoding_of(target).slots if slot is not c.slot)


class _HostSyncs:
    """Counts the calls that bring a tensor's value to the host (tolist, item, bool, int) made from specdistill's
    decoding code (the caller's file under specdistill/decoding or specdistill/drafts), per calling function."""

    ROOTS = (os.path.join("specdistill", "decoding"), os.path.join("specdistill", "drafts"))

    def __init__(self, monkeypatch):
        self.by_function: dict[str, int] = {}
        for name in ("tolist", "item", "__bool__", "__int__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def counted(tensor, *args):
            import sys

            frame = sys._getframe(1)
            if any(root in frame.f_code.co_filename for root in self.ROOTS):
                name = frame.f_code.co_name
                self.by_function[name] = self.by_function.get(name, 0) + 1
            return original(tensor, *args)

        return counted


@torch.no_grad()
@pytest.mark.parametrize("drafter_kind", ["lm", "eagle3"])
def test_a_speculative_round_syncs_the_host_once(drafter_kind, monkeypatch):
    """Over a whole call, the round loop (speculative_generate's own body and the commits it calls) brings values
    to the host once per round: the commits' crop sizes travel with the loop control."""
    if drafter_kind == "lm":
        target = tiny_target("llama")
        drafter = LMDrafter(_perturbed(target, 0.1))
        ids, mask = left_padded_prompts([7, 4, 3], seed=0, vocab=320)
    else:
        target = make_tiny_lm(V, layers=4, hidden=32, seed=0).eval()
        drafter = Eagle3Drafter(noisy_eagle3_head(target, V, 0).eval())
        ids, mask = left_padded_prompts([7, 4, 3], seed=0, vocab=V)
    syncs = _HostSyncs(monkeypatch)
    rollout = speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=12)
    in_rounds = {f: n for f, n in syncs.by_function.items()
                 if f not in ("_check_inputs", "start", "prefill")}  # once per call, before the first round
    assert len(rollout.rounds) >= 3
    assert sum(in_rounds.values()) == len(rollout.rounds), in_rounds


@torch.no_grad()
@pytest.mark.parametrize("cache", [CacheMode(), COMPILED])
def test_target_decoding_that_syncs_every_few_steps_emits_the_same_tokens(cache):
    """sync_every=k checks for stopped rows every k steps: the same tokens and counts as every step (rows that hit EOS
    stop emitting on time), one round_seconds entry per decode step, and the host syncs k times fewer."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts([7, 4, 3], seed=2, vocab=320)
    every = target_generate(target, ids, mask, max_new_tokens=13, cache=cache)
    eos = int(every.sequences[1, 2])  # row 1 stops at its third token (other rows maybe later or never)
    every = target_generate(target, ids, mask, max_new_tokens=13, eos_token_id=eos, cache=cache)
    few = target_generate(target, ids, mask, max_new_tokens=13, eos_token_id=eos, cache=cache, sync_every=4)
    assert int(every.num_new_tokens[1]) == 3
    assert torch.equal(few.sequences, every.sequences) and torch.equal(few.num_new_tokens, every.num_new_tokens)
    assert torch.equal(few.target_forwards, every.target_forwards)
    steps = int(every.num_new_tokens.max())
    assert len(every.round_seconds) == steps and steps <= len(few.round_seconds) < steps + 4
    assert abs(few.decode_seconds - sum(few.round_seconds)) < 1e-9
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        target_generate(target, ids, mask, max_new_tokens=4, sync_every=0)
