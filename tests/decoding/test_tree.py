"""Token trees: expansion by cumulative draft probability, tree attention in one target forward, path commits, and
lossless tree decoding (greedy token-identical to the target on the architecture matrix, sampling by chi-square).

Drafts are the target's weights plus noise (tests.decoding.test_architectures), so their second and third choices
are often the target's first: trees accept branches other than the first, which the tests assert.
"""

import pytest
import torch

from specdistill.decoding import CacheMode, LMDrafter, NGramDrafter, speculative_generate, target_generate
from specdistill.decoding.kv import BatchKV
from specdistill.decoding.tree import Proposal, TreeShape, grow
from tests.decoding.conftest import RecordsTrees, branch_counts
from tests.decoding.test_architectures import CASES, NOISE, _perturbed, _prompts
from tests.tiny_archs import ARCHITECTURES, tiny_target

MAX_NEW = 20
SHAPES = [TreeShape(2, 3), TreeShape(3, 3, nodes=8), TreeShape(4, 2)]


class _Recording(RecordsTrees, LMDrafter):
    """An LMDrafter that keeps every round's tree and accepted path."""


# ------------------------------------------------------------------------------------------------- shapes
def test_bad_tree_shapes_are_refused_by_name(tiny_lm):
    for kwargs, message in [(dict(topk=0), "topk=0"), (dict(depth=0), "depth=0"), (dict(nodes=0), "nodes=0"),
                            (dict(topk=2, depth=2, nodes=7), r"nodes=7 exceeds the 6 nodes"),
                            (dict(topk=8, depth=6), "exceeds 256")]:
        with pytest.raises(ValueError, match=message):
            TreeShape(**kwargs)
    target = tiny_lm(0)
    ids = torch.randint(3, 48, (1, 5))
    with pytest.raises(ValueError, match="NGramDrafter proposes one token per position"):
        speculative_generate(target, NGramDrafter(), ids, strategy=TreeShape(2, 2), max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_policy='sample' with a token tree"):
        speculative_generate(target, LMDrafter(tiny_lm(1)), ids, strategy=TreeShape(2, 2), max_new_tokens=4,
                             temperature=1.0, draft_policy="sample")
    with pytest.raises(ValueError, match="topk=64 exceeds the draft's vocabulary of 48"):
        speculative_generate(target, LMDrafter(tiny_lm(1)), ids, strategy=TreeShape(64, 1), max_new_tokens=4)


def test_sglang_flags_count_the_root():
    assert TreeShape(4, 3, nodes=15).sglang_flags() == {"--speculative-eagle-topk": 4, "--speculative-num-steps": 3,
                                                         "--speculative-num-draft-tokens": 16}
    assert TreeShape(2, 3).size == 2 + 2 * 4


@pytest.mark.parametrize("shape", [TreeShape(3, 3), TreeShape(3, 4, nodes=9), TreeShape(1, 4)])
def test_grow_keeps_the_best_scored_nodes_as_a_tree(shape):
    """Random draft logits: parents precede children, scores add up along paths, siblings are distinct tokens, and a
    best-N tree keeps the N best scores of everything the expansion scored."""
    g = torch.Generator().manual_seed(0)
    B, V = 3, 20
    fed = []

    def feed(tokens, visible, d, parent):
        fed.append((tokens, visible, d, parent))
        return torch.randn(B, tokens.shape[1], V, generator=g) * 3

    tree = grow(shape, torch.randn(B, V, generator=g) * 3, feed)
    N = tree.num_nodes
    assert N == shape.size and len(fed) == shape.depth - 1
    assert bool((tree.parents < torch.arange(1, N + 1)).all())
    parent_depth = torch.nn.functional.pad(tree.depth, (1, 0)).gather(1, tree.parents)
    assert torch.equal(tree.depth, parent_depth + 1)
    parent_score = torch.nn.functional.pad(tree.score, (1, 0)).gather(1, tree.parents)
    assert bool((tree.score <= parent_score + 1e-6).all())
    children = tree.children()                                                       # (B, N+1, k)
    for b in range(B):
        for kids in children[b]:
            kids = kids[kids > 0]
            assert len(set(tree.tokens[b, kids - 1].tolist())) == len(kids) <= shape.topk
    # Each fed beam sees exactly its fed ancestors and itself.
    ancestors = tree.ancestors()
    k = shape.topk
    for _, visible, d, parent in fed:
        assert visible.shape == (B, k, d * k)
        assert bool(visible.sum(2).eq(d).all())  # d fed nodes on its path: depths 1..d
        if d > 1:  # the one beam of depth d-1 it sees is the parent it is told of
            assert torch.equal(visible[:, :, (d - 2) * k: (d - 1) * k].int().argmax(2), parent)
    assert torch.equal(ancestors.sum(2), tree.depths() + 1)


def test_tree_helpers_on_a_hand_made_tree():
    #        root
    #      1      2
    #    3   4    5
    #    6
    tree = Proposal(tokens=torch.tensor([[10, 11, 12, 13, 14, 15]]), parents=torch.tensor([[0, 0, 1, 1, 2, 3]]),
                    depth=torch.tensor([[1, 1, 2, 2, 2, 3]]), score=torch.zeros(1, 6), fed=torch.full((1, 6), -1),
                    topk=2)
    assert tree.children()[0].tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]]
    path, depth = tree.path(torch.tensor([6]))
    assert path.tolist() == [[0, 1, 3, 6]] and depth.tolist() == [3]
    path, depth = tree.path(torch.tensor([5]))
    assert path.tolist() == [[0, 2, 5, 0]] and depth.tolist() == [2]
    assert tree.ancestors()[0, 4].nonzero().flatten().tolist() == [0, 1, 4]


# ------------------------------------------------------------------------------------------------- attention, KV
def _tree_step(target, ids, mask, tree: Proposal, root: torch.Tensor):
    kv = BatchKV(target)
    kv.prefill(ids, mask)
    depths = tree.depths()
    out = kv.step(torch.cat([root[:, None], tree.tokens], 1), positions=kv.length[:, None] + depths,
                  tail_visible=tree.ancestors())
    return kv, out.logits


def _random_tree(B: int, V: int, shape: TreeShape, seed: int) -> Proposal:
    g = torch.Generator().manual_seed(seed)
    return grow(shape, torch.randn(B, V, generator=g),
                lambda t, v, d, parent: torch.randn(B, t.shape[1], V, generator=g))


def _dense_logits(target, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    return target(torch.tensor([prompt + continuation])).logits[0, -1]


@torch.no_grad()
@pytest.mark.parametrize("arch, attn", CASES)
def test_the_tree_mask_equals_a_per_path_reference_forward(arch, attn):
    """One forward over a tree on a left-padded cached batch = a plain forward of each node's own path (no cache, no
    padding, no tree), to 1e-5: ancestors seen, siblings and cousins hidden, positions by depth, windows by position.
    sdpa takes the 4D mask as booleans, eager as an additive float mask."""
    target = tiny_target(arch, attn_implementation=attn)
    ids, mask = _prompts()
    tree = _random_tree(3, 320, TreeShape(3, 3, nodes=10), seed=1)
    root = torch.tensor([5, 6, 7])
    _, logits = _tree_step(target, ids, mask, tree, root)                            # (B, N+1, V)
    for b in range(3):
        prompt = ids[b][mask[b].bool()].tolist()
        for node in range(tree.num_nodes + 1):
            path, n = tree.path(torch.tensor([node]).expand(3))
            tokens = [int(root[b])] + [int(tree.tokens[b, j - 1]) for j in path[b, 1: int(n[b]) + 1]]
            ref = _dense_logits(target, prompt, tokens)
            torch.testing.assert_close(logits[b, node], ref, atol=1e-5, rtol=0, msg=f"{arch} row {b} node {node}")


@torch.no_grad()
@pytest.mark.parametrize("arch, max_length", [("llama", None), ("gemma3", None), ("mistral", 64)])
def test_committing_a_non_first_branch_keeps_exactly_its_path(arch, max_length):
    """Commit paths that end under a second child: the kept columns are the path's (moved within the tail only, each
    layer's storage stays where the tree step put it), and the next token's logits equal a dense forward over the
    prompt and the path."""
    target = tiny_target(arch)
    ids, mask = _prompts()
    tree = Proposal(tokens=torch.tensor([[10, 11, 12, 13, 14]] * 3), parents=torch.tensor([[0, 0, 1, 2, 2]] * 3),
                    depth=torch.tensor([[1, 1, 2, 2, 2]] * 3), score=torch.zeros(3, 5), fed=torch.full((3, 5), -1),
                    topk=2)
    #  root -> 1 -> 3;  root -> 2 -> {4, 5}: row 0 keeps root,2,5 (second children twice), row 1 root,2, row 2 root
    last = torch.tensor([5, 2, 0])
    path, n = tree.path(last)
    kv = BatchKV(target, max_length=max_length)
    kv.prefill(ids, mask)
    S0 = kv.committed
    kv.step(torch.cat([torch.tensor([5, 6, 7])[:, None], tree.tokens], 1),
            positions=kv.length[:, None] + tree.depths(), tail_visible=tree.ancestors())
    storage = [layer.keys.data_ptr() for layer in kv.cache.layers]
    kv.commit_path(path, n + 1)
    assert kv.committed == S0 + 3 and kv.mask[:, S0:].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert [layer.keys.data_ptr() for layer in kv.cache.layers] == storage
    nxt = kv.step(torch.tensor([[20], [21], [22]])).logits[:, -1]
    for b, kept in enumerate([[5, 11, 14], [6, 11], [7]]):
        ref = _dense_logits(target, ids[b][mask[b].bool()].tolist(), kept + [20 + b])
        torch.testing.assert_close(nxt[b], ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------- decoding
@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tree_decoding_is_token_identical_to_target_only(arch):
    target = tiny_target(arch)
    drafter = _Recording(_perturbed(target, NOISE.get(arch, 0.1)))
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=MAX_NEW)
    accepted = later = rejected = 0
    for shape in SHAPES:
        r = speculative_generate(target, drafter, ids, mask, strategy=shape, max_new_tokens=MAX_NEW)
        assert torch.equal(r.sequences, reference.sequences), f"{arch} {shape.name}"
        counts = branch_counts(drafter)
        accepted, later, rejected = accepted + counts[0], later + counts[1], rejected + counts[2]
        assert torch.equal(sum(rnd.num_emitted for rnd in r.rounds), r.num_new_tokens)
        assert r.accept_hist.sum() == r.target_forwards.sum() == sum(int(rnd.active.sum()) for rnd in r.rounds)
    assert accepted > 20 and later > 3 and rejected > 10, f"{arch}: {accepted} accepted, {later} on later branches, " \
                                                          f"{rejected} rejections"


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_static_caches_decode_the_same_trees(arch):
    target = tiny_target(arch)
    ids, mask = _prompts()
    draft = _perturbed(target, NOISE.get(arch, 0.1))
    shape = TreeShape(3, 3, nodes=8)
    growing = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=shape, max_new_tokens=40)
    static = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=shape, max_new_tokens=40,
                                  cache=CacheMode(static=True))
    assert torch.equal(static.sequences, growing.sequences)
    assert torch.equal(static.position_accepted, growing.position_accepted)


class _GrownChains(LMDrafter):
    """Proposes a chain as the token tree of width 1 it is: grown by tree.grow with tree attention, verified as a
    tree, committed by its path."""

    def propose(self, shape, sampler):
        return self._tree(shape)


@torch.no_grad()
def test_a_topk_1_tree_is_the_chain(tiny_lm, ragged_prompts):
    target, draft = tiny_lm(0), tiny_lm(1)
    ids, mask = ragged_prompts
    chain = speculative_generate(target, LMDrafter(draft), ids, mask, strategy=3, max_new_tokens=MAX_NEW)
    tree = speculative_generate(target, _GrownChains(draft), ids, mask, strategy=TreeShape(1, 3),
                                max_new_tokens=MAX_NEW)
    assert all(not r.proposal.is_chain for r in tree.rounds)
    assert torch.equal(tree.sequences, chain.sequences)
    assert torch.equal(tree.accept_hist, chain.accept_hist)
    assert torch.equal(tree.position_accepted, chain.position_accepted)
    assert torch.equal(tree.target_forwards, chain.target_forwards)


@torch.no_grad()
def test_tree_sampling_follows_the_target_on_a_left_padded_batch(chi_square_pvalue, first_three_marginals,
                                                                interleaved_prompts):
    """T=1, three prompt lengths interleaved in one left-padded batch, a sliding window shorter than every prompt,
    ragged acceptance along different branches: each row's first three tokens follow the target's exact marginals."""
    V, N = 16, 1500
    target = tiny_target("mistral", vocab_size=V, sliding_window=3)
    drafter = _Recording(_perturbed(target, 0.3))
    prompts = [[3, 9, 4, 9, 4], [7, 2, 5, 8], [5, 11, 6, 8, 13, 10]]
    K = len(prompts)
    ids, mask = interleaved_prompts(prompts, N)
    out = speculative_generate(target, drafter, ids, mask, strategy=TreeShape(3, 2, nodes=5), max_new_tokens=3,
                               temperature=1.0, generator=torch.Generator().manual_seed(0))
    accepted, later, rejected = branch_counts(drafter)
    assert later > 0.1 * accepted and rejected > 0.1 * N * K
    for k, prompt in enumerate(prompts):
        rows = out.sequences[k::K]                                                          # (N, 3)
        for i, p in enumerate(first_three_marginals(target, prompt, V)):
            counts = torch.bincount(rows[:, i], minlength=V)
            assert chi_square_pvalue(counts, p) > 1e-3, f"prompt of {len(prompt)} tokens, token {i}"


@torch.no_grad()
def test_long_tree_decoding_crosses_front_crops_and_compactions(monkeypatch):
    """Gemma-3 (sliding and full layers, growing caches), 100 tokens with EOS: the sliding layers drop columns from
    their front and the caches compact while paths are committed; the output stays the target's."""
    calls = {"_crop_front": 0, "compact": 0}
    for name in calls:
        original = getattr(BatchKV, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(BatchKV, name, counted)
    target = tiny_target("gemma3")
    ids, mask = _prompts()
    reference = target_generate(target, ids, mask, max_new_tokens=100, eos_token_id=2)
    r = speculative_generate(target, LMDrafter(_perturbed(target, 0.3)), ids, mask, strategy=TreeShape(4, 4, nodes=12),
                             max_new_tokens=100, eos_token_id=2)
    assert torch.equal(r.sequences, reference.sequences)
    assert calls["_crop_front"] > 0 and calls["compact"] > 0
