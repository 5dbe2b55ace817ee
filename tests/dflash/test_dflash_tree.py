"""DFlash token trees: one block forward scores the children of every node of a depth, decoding stays lossless
(greedy token-identical to target-only decoding with branches other than the first accepted, sampling by chi-square
on a left-padded batch), a topk-1 tree is the chain, and a tree deeper than the block is refused by name."""

import pytest
import torch

from specdistill.config import EvalConfig, TreeEvalConfig
from specdistill.decoding import speculative_generate, target_generate
from specdistill.decoding.tree import TreeShape
from specdistill.drafts.dflash import DFlashDrafter
from tests.conftest import left_padded_prompts
from tests.decoding.conftest import (RecordsTrees, _chi_square_pvalue, _first_three_marginals, _interleaved,
                                     branch_counts)
from tests.dflash.conftest import tiny_dflash, tiny_target


class Recording(RecordsTrees, DFlashDrafter):
    """A DFlashDrafter that keeps every round's tree and accepted path."""


@torch.no_grad()
@pytest.mark.parametrize("vd", [None, 30])
def test_greedy_tree_decoding_is_token_identical_to_target_only(vd):
    target = tiny_target(sharpen=2.0)
    draft = tiny_dflash(target, 4, vocab=None if vd is None else torch.arange(3, 3 + vd))
    ids, mask = left_padded_prompts([9, 5, 2, 7, 4, 8, 3, 6], seed=1)
    reference = target_generate(target, ids, mask, max_new_tokens=24)
    drafter = Recording(draft)
    accepted = later = rejected = 0
    for shape in [TreeShape(2, 3), TreeShape(3, 3, nodes=8), TreeShape(4, 2)]:
        r = speculative_generate(target, drafter, ids, mask, strategy=shape, max_new_tokens=24)
        assert torch.equal(r.sequences, reference.sequences), shape.name
        assert r.accept_hist.sum() == r.target_forwards.sum() == sum(int(rnd.active.sum()) for rnd in r.rounds)
        if vd is not None:
            assert all(bool(draft.t2d[tree.tokens].all()) for tree in drafter.trees), "nodes in the draft vocabulary"
        counts = branch_counts(drafter)
        accepted, later, rejected = accepted + counts[0], later + counts[1], rejected + counts[2]
    assert accepted > 10 and later > 2 and rejected > 10, f"{accepted} accepted, {later} on later branches, " \
                                                         f"{rejected} rejections"


@torch.no_grad()
def test_every_node_of_a_depth_gets_the_block_positions_top_k():
    target = tiny_target()
    draft = tiny_dflash(target, 4)
    ids, mask = left_padded_prompts([6, 3], seed=2)
    drafter = Recording(draft)
    speculative_generate(target, drafter, ids, mask, strategy=TreeShape(3, 3), max_new_tokens=8)
    tree = drafter.trees[0]
    for b in range(2):
        for d in (2, 3):
            at = tree.depth[b] == d
            parents = tree.parents[b][at].unique()
            assert len(parents) == 3
            sets = [sorted(tree.tokens[b][at & (tree.parents[b] == p)].tolist()) for p in parents]
            assert all(s == sets[0] for s in sets), f"row {b} depth {d}: {sets}"


class _GrownChains(DFlashDrafter):
    """Proposes a chain as the token tree of width 1 it is (tree.grow), verified and committed as a tree."""

    def propose(self, shape, sampler):
        return self._tree(shape)


@torch.no_grad()
def test_a_topk_1_tree_is_the_chain():
    target = tiny_target()
    draft = tiny_dflash(target, 4)
    ids, mask = left_padded_prompts([9, 5, 2, 7], seed=1)
    chain = speculative_generate(target, DFlashDrafter(draft), ids, mask, strategy=3, max_new_tokens=20)
    tree = speculative_generate(target, _GrownChains(draft), ids, mask, strategy=TreeShape(1, 3), max_new_tokens=20)
    assert all(not r.proposal.is_chain for r in tree.rounds)
    assert torch.equal(tree.sequences, chain.sequences)
    assert torch.equal(tree.accept_hist, chain.accept_hist)
    assert torch.equal(tree.position_accepted, chain.position_accepted)


@torch.no_grad()
def test_tree_sampling_follows_the_target_on_a_left_padded_batch():
    """T=1, three prompt lengths interleaved in one left-padded batch, ragged acceptance along different branches:
    each row's first three tokens follow the target's exact marginals."""
    V, N = 48, 1500
    target = tiny_target(sharpen=2.0)
    drafter = Recording(tiny_dflash(target, 4))
    prompts = [[3, 9, 4, 9, 4], [7, 2, 5, 8], [5, 11, 6, 8, 13, 10]]
    K = len(prompts)
    ids, mask = _interleaved(prompts, N)
    out = speculative_generate(target, drafter, ids, mask, strategy=TreeShape(3, 2, nodes=5), max_new_tokens=3,
                               temperature=1.0, generator=torch.Generator().manual_seed(0))
    accepted, later, rejected = branch_counts(drafter)
    assert later > 0.05 * accepted and rejected > 0.1 * N * K, (accepted, later, rejected)
    for k, prompt in enumerate(prompts):
        rows = out.sequences[k::K]                                                          # (N, 3)
        for i, p in enumerate(_first_three_marginals(target, prompt, V)):
            counts = torch.bincount(rows[:, i], minlength=V)
            assert _chi_square_pvalue(counts, p) > 1e-3, f"prompt of {len(prompt)} tokens, token {i}"


def test_a_tree_deeper_than_the_block_is_refused_by_name():
    from specdistill.eval.evaluator import evaluate
    from tests.conftest import make_tokenizer

    target = tiny_target()
    draft = tiny_dflash(target, 4)
    ids, mask = left_padded_prompts([5, 3], seed=0)
    with pytest.raises(ValueError, match="tree depth=4 exceeds what a block of 4 drafts"):
        speculative_generate(target, DFlashDrafter(draft), ids, mask, strategy=TreeShape(2, 4), max_new_tokens=8)
    tok = make_tokenizer()
    target.resize_token_embeddings(len(tok))
    cfg = EvalConfig(max_new_tokens=8, warmup_prompts=0, tree=TreeEvalConfig(topk=2, depth=4))
    with pytest.raises(ValueError, match=r"eval.tree.depth=4 exceeds the 3 draft .* <= 3"):
        evaluate(target, tok, draft, [[{"role": "user", "content": "hi"}]], cfg, progress=False)
