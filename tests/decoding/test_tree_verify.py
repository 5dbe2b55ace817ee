"""Tree verification on hand-made tensors: which path greedy keeps, never / always accepted siblings, and the emitted
tokens' distribution under recursive rejection (deterministic top-k children and children drawn from q)."""

import torch

from specdistill.decoding.tree import Proposal
from specdistill.decoding.verify import verify

V = 6
#          root
#    1(a=1)  2(b=2)  3(c=3)
#    4(d=4)  5(e=0)
PARENTS, DEPTH, TOKENS = [0, 0, 0, 1, 2], [1, 1, 1, 2, 2], [1, 2, 3, 4, 0]


def _tree(B: int, tokens=TOKENS, probs=None) -> Proposal:
    tokens = torch.as_tensor(tokens).expand(B, -1) if torch.as_tensor(tokens).dim() == 1 else torch.as_tensor(tokens)
    return Proposal(tokens=tokens, probs=probs, parents=torch.tensor(PARENTS).expand(B, -1),
                    depth=torch.tensor(DEPTH).expand(B, -1), score=torch.zeros(B, 5), fed=torch.full((B, 5), -1),
                    topk=3)


def _one_hot_logits(argmax: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmax), V).float()[None] * 5     # (1, N+1, V)


def test_greedy_keeps_the_longest_matching_path_through_a_second_child():
    # The target's argmax after root is b (node 2), after node 2 is e=0 (node 5), after node 5 anything.
    v = verify(_tree(1), _one_hot_logits([2, 4, 0, 5, 5, 3]))
    assert v.path.tolist() == [[0, 2, 5]] and v.num_accepted.tolist() == [2]
    assert v.tokens.tolist() == [[2, 0, 3]] and v.next_token.tolist() == [3]
    assert v.alpha.tolist() == [[1.0, 1.0]]
    # No child matches: nothing accepted, the correction is the root's argmax, alpha 0 at depth 1.
    v = verify(_tree(1), _one_hot_logits([5, 4, 0, 5, 5, 3]))
    assert v.path.tolist() == [[0, 0, 0]] and v.tokens.tolist() == [[5, -1, -1]] and v.alpha.tolist() == [[0.0, 0.0]]


def test_sampling_never_accepts_a_zero_probability_sibling_and_always_one_with_all_the_mass():
    B = 200
    p = torch.zeros(B, 6, V)
    p[:, 0, 2] = 1.0             # root: all mass on b (node 2), none on a (node 1)
    p[:, 2, :] = 1.0 / V         # node 2: uniform, e=0 (node 5) accepted 1/6 of the time
    p[:, 1:, :] += 1e-9
    v = verify(_tree(B), target_probs=p, generator=torch.Generator().manual_seed(0))
    assert bool((v.path[:, 1] == 2).all())                                           # never 1, always 2
    deeper = v.num_accepted == 2
    assert 0.05 < deeper.float().mean() < 0.35
    assert bool((v.path[deeper, 2] == 5).all())
    assert torch.allclose(v.alpha[:, 0], torch.ones(B))


def _chi_square_first_and_second(chi_square_pvalue, v, p_root: torch.Tensor, p_child: dict[int, torch.Tensor]):
    first = v.tokens[:, 0]
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p_root) > 1e-3
    for node, probs in p_child.items():  # after accepting node, the next token follows that node's row
        rows = v.path[:, 1] == node
        second = v.tokens[rows, 1]
        assert rows.sum() > 150
        assert chi_square_pvalue(torch.bincount(second, minlength=V), probs) > 1e-3, f"after node {node}"


def test_recursive_rejection_over_top_k_siblings_emits_the_target_distribution(chi_square_pvalue):
    B = 20000
    g = torch.Generator().manual_seed(1)
    p_rows = torch.softmax(torch.randn(6, V, generator=g) * 1.5, -1)                 # (N+1, V)
    v = verify(_tree(B), target_probs=p_rows.expand(B, -1, -1), generator=g)
    assert 0 < int((v.path[:, 1] == 2).sum()) and 0 < int((v.path[:, 1] == 3).sum())  # later siblings accepted
    # After node 1 (token a) and node 2 (token b) the round goes on; node 3 is a leaf: its bonus follows row 3.
    _chi_square_first_and_second(chi_square_pvalue, v, p_rows[0], {1: p_rows[1], 2: p_rows[2], 3: p_rows[3]})


def test_recursive_rejection_over_children_drawn_from_q_emits_the_target_distribution(chi_square_pvalue):
    """SpecInfer's case: each node's children are drawn independently from its q (duplicates allowed)."""
    B = 20000
    g = torch.Generator().manual_seed(2)
    p_rows = torch.softmax(torch.randn(6, V, generator=g) * 0.7, -1)                 # (N+1, V)
    q_rows = torch.softmax(torch.randn(6, V, generator=g) * 0.7, -1)
    parents = torch.tensor(PARENTS)
    tokens = torch.multinomial(q_rows[parents], B, replacement=True, generator=g).T   # (B, N) child ~ q_parent
    q = q_rows[parents].expand(B, -1, -1)                                            # (B, N, V) each node's q
    v = verify(_tree(B, tokens, q), target_probs=p_rows.expand(B, -1, -1), generator=g)
    _chi_square_first_and_second(chi_square_pvalue, v, p_rows[0], {1: p_rows[1], 2: p_rows[2]})


def test_a_chain_verifies_as_the_tree_of_width_one():
    """The chain fast path and the tree path agree on a chain written as a tree (node i's parent is node i-1): same
    accepted drafts, next token and emitted tokens, the tree's path the chain's prefix; same attention and contexts."""
    g = torch.Generator().manual_seed(0)
    B, K = 256, 4
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, logits[:, :K].argmax(-1),
                         torch.randint(0, V, (B, K), generator=g))
    chain = Proposal(drafts)
    tree = Proposal(drafts, parents=torch.arange(K).expand(B, -1), depth=torch.arange(1, K + 1).expand(B, -1),
                    score=torch.zeros(B, K), fed=torch.full((B, K), -1), topk=1)
    a, b = verify(chain, logits), verify(tree, logits)
    assert a.path is None and 0 < int(a.num_accepted.sum()) < B * K
    for field in ("accepted", "num_accepted", "next_token", "tokens"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    on = torch.arange(K + 1) <= a.num_accepted[:, None]
    assert torch.equal(b.path, torch.where(on, torch.arange(K + 1), 0))
    for method in ("ancestors", "depths", "children", "contexts"):
        assert torch.equal(getattr(chain, method)(), getattr(tree, method)()), method
