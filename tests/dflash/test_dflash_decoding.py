"""DFlashDrafter in the decoding loop: lossless for every block size, and every round's block is the model's
training-form forward over exactly the verified tokens (the injected-context cache cropped on rejection)."""

import pytest
import torch

from specdistill.decoding import probs_from_logits, speculative_generate, target_generate
from specdistill.drafts.dflash import DFlashDrafter
from tests.conftest import left_padded_prompts
from tests.dflash.conftest import V, tiny_dflash, tiny_target


class Traced(DFlashDrafter):
    """Keeps each round's anchor, anchor position, activity and block logits, and checks the cache after commits."""

    def __init__(self, model):
        super().__init__(model)
        self.trace = []

    def propose(self, shape, sampler):
        proposal = super().propose(shape, sampler)
        self.trace.append((self.anchor.clone(), self.anchor_pos.clone(), self.logits.clone()))
        return proposal

    def commit(self, num_accepted, next_token, active, target_hidden=None, path=None):
        super().commit(num_accepted, next_token, active, target_hidden, path)
        real = self.cache.valid.sum(1)                                     # (B,) context slots kept per row
        W = self.model.config.sliding_window
        want = self.anchor_pos if W is None else self.anchor_pos.clamp(max=W)
        assert torch.equal(real[active], want[active]), "the cache holds exactly the verified context"


@torch.no_grad()
def _check_rounds(target, draft, ids, mask, rollout, trace) -> int:
    """Each round's block logits equal the training-form forward (model.forward) over the row's final sequence with
    the block anchored at the round's pending token: the cache held the verified tokens' features only."""
    checked = 0
    for b in range(ids.shape[0]):
        seq = torch.cat([ids[b][mask[b].bool()], rollout.sequences[b, : int(rollout.num_new_tokens[b])]])[None]
        hidden = target(seq, output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[k] for k in draft.config.aux_layer_ids], -1)   # (1, L, D)
        valid = torch.ones(1, seq.shape[1], dtype=torch.bool)
        for rnd, (anchor, pos, logits) in zip(rollout.rounds, trace):
            if not bool(rnd.active[b]):
                continue
            a = int(pos[b])
            assert int(seq[0, a]) == int(anchor[b])
            ref = draft.logits(draft(feats, valid, anchor[b].view(1, 1), pos[b].view(1, 1))[0, 0, 1:])  # (B-1, Vd)
            torch.testing.assert_close(logits[b], ref[: logits.shape[1]], atol=1e-4, rtol=1e-4)
            checked += 1
    return checked


@pytest.mark.parametrize("block_size, vd", [(2, None), (4, None), (8, None), (4, 30)])
def test_greedy_equals_target_for_every_block_size(block_size, vd):
    target = tiny_target()
    draft = tiny_dflash(target, block_size, vocab=None if vd is None else torch.arange(3, 3 + vd))
    ids, mask = left_padded_prompts([9, 5, 2, 7, 4, 8, 3, 6], seed=1)
    drafter = Traced(draft)
    r = speculative_generate(target, drafter, ids, mask, strategy=block_size - 1, max_new_tokens=24, record=True)
    ref = target_generate(target, ids, mask, max_new_tokens=24)
    assert torch.equal(r.sequences, ref.sequences)
    assert int(r.accept_hist[:-1].sum()) > 0, "some rounds rejected a draft"
    assert int(r.position_accepted.sum()) > 0, "some drafts were accepted"
    assert all(rnd.gamma <= block_size - 1 for rnd in r.rounds)
    assert all(bool(draft.t2d[rnd.draft_tokens].all()) for rnd in r.rounds)  # drafts inside the draft vocabulary
    assert _check_rounds(target, draft, ids, mask, r, drafter.trace) >= len(r.rounds)


def test_a_sliding_window_crops_the_context():
    target = tiny_target()
    draft = tiny_dflash(target, 4, sliding_window=5)
    ids, mask = left_padded_prompts([9, 5, 2, 7], seed=1)
    drafter = Traced(draft)
    r = speculative_generate(target, drafter, ids, mask, strategy=3, max_new_tokens=30, record=True)
    assert torch.equal(r.sequences, target_generate(target, ids, mask, max_new_tokens=30).sequences)
    assert int(drafter.cache.valid.sum(1).max()) <= 5
    assert _check_rounds(target, draft, ids, mask, r, drafter.trace) >= len(r.rounds)


def test_a_block_wider_than_gamma_proposes_gamma():
    target = tiny_target()
    draft = tiny_dflash(target, 8)
    ids, mask = left_padded_prompts([6, 3], seed=2)
    r = speculative_generate(target, DFlashDrafter(draft), ids, mask, strategy=3, max_new_tokens=12, record=True)
    assert max(rnd.gamma for rnd in r.rounds) == 3
    assert torch.equal(r.sequences, target_generate(target, ids, mask, max_new_tokens=12).sequences)


@pytest.mark.parametrize("vd", [None, 36])
def test_sampled_verification_keeps_the_target_distribution(vd, chi_square_pvalue):
    """Drafts sampled from the block's q_k (draft_policy=sample) and verified with it: the first three tokens are
    distributed as the target's (exact marginals over all V^2 continuations)."""
    N = 3000
    target = tiny_target(sharpen=2.0)
    draft = tiny_dflash(target, 4, vocab=None if vd is None else torch.arange(V - vd, V))
    prompt = torch.tensor([[3, 9, 4, 9, 4]])
    n = prompt.shape[1]
    x1, x2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    with torch.no_grad():
        seqs = torch.cat([prompt.expand(V * V, -1), x1.reshape(-1, 1), x2.reshape(-1, 1)], 1)
        probs = probs_from_logits(target(seqs).logits, 1.0)                           # (V*V, n+2, V)
    p1 = probs[0, n - 1]
    joint12 = p1[:, None] * probs[::V, n]                                              # (V, V)
    p3 = (joint12[..., None] * probs[:, n + 1].reshape(V, V, V)).sum((0, 1))
    r = speculative_generate(target, DFlashDrafter(draft), prompt.expand(N, -1), strategy=3, max_new_tokens=3,
                             temperature=1.0, draft_policy="sample", generator=torch.Generator().manual_seed(0),
                             record=True)
    for i, p in enumerate((p1, joint12.sum(0), p3)):
        counts = torch.bincount(r.sequences[:, i], minlength=V)
        assert chi_square_pvalue(counts, p) > 1e-3, f"token {i}"
    assert 0.05 < r.acceptance_per_position[0] < 0.95  # both the accept and the resample paths were exercised
