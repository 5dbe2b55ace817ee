"""Fixtures for the decoding/ tests: seeded tiny Llama models built from configs, a chi-square p-value, and exact
marginals of a target's first sampled tokens."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.decoding import probs_from_logits

from tests.conftest import left_padded_prompts, single_thread


def _tiny_lm(seed: int = 0, vocab: int = 48, max_positions: int = 256, init_std: float = 0.2) -> LlamaForCausalLM:
    # init_std 0.2 (not HF's 0.02) makes the distributions peaked and two seeds disagree: alpha ~0.4.
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
                         initializer_range=init_std, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of counts (V,) to probs (V,); cells expecting < 5 are pooled."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    expected = counts.sum() * probs
    if bool((counts[probs == 0] > 0).any()):
        return 0.0  # an impossible outcome was observed
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))


@torch.no_grad()
def _first_three_marginals(target, prompt: list[int], V: int) -> list[torch.Tensor]:
    """Exact marginals (V,) of the target's first three sampled tokens (T=1) after `prompt`: all V^2 two-token
    continuations in one forward."""
    n = len(prompt)
    x1, x2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")                # (V, V) each
    seqs = torch.cat([torch.tensor(prompt).expand(V * V, -1), x1.reshape(-1, 1), x2.reshape(-1, 1)], 1)
    probs = probs_from_logits(target(seqs).logits, 1.0)                                     # (V*V, n+2, V)
    p1 = probs[0, n - 1]                                                                    # (V,)
    p2_given_1 = probs[::V, n]                                                              # (V, V) [x1, x2]
    p3_given_12 = probs[:, n + 1].reshape(V, V, V)                                          # [x1, x2, x3]
    joint_12 = p1[:, None] * p2_given_1                                                     # (V, V)
    return [p1, joint_12.sum(0), (joint_12[..., None] * p3_given_12).sum((0, 1))]


one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


@pytest.fixture
def tiny_lm():
    return _tiny_lm


@pytest.fixture
def chi_square_pvalue():
    return _chi_square_pvalue


@pytest.fixture
def ragged_prompts():
    """Left-padded (4, 9) prompts of lengths 9, 5, 2, 7 (pad id 0), seeded."""
    return left_padded_prompts([9, 5, 2, 7], seed=123)


@pytest.fixture
def first_three_marginals():
    return _first_three_marginals


def _interleaved(prompts: list[list[int]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n * K, L) left-padded ids and mask whose rows cycle through the K prompts: every length sits next to every
    other one, so one batch mixes paddings (and, once acceptance is ragged, cache holes)."""
    L, K = max(map(len, prompts)), len(prompts)
    ids = torch.zeros(n * K, L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r in range(n * K):
        p = prompts[r % K]
        ids[r, L - len(p):], mask[r, L - len(p):] = torch.tensor(p), 1
    return ids, mask


@pytest.fixture
def interleaved_prompts():
    return _interleaved


class RecordsTrees:
    """Mixin for a drafter that grows token trees (class Recording(RecordsTrees, LMDrafter)): keeps every round's tree
    and accepted path, for branch_counts()."""

    def start(self, *args, **kwargs):
        self.trees, self.paths = [], []
        super().start(*args, **kwargs)

    def commit_begin(self, num_accepted, next_token, active, target_hidden=None, path=None):
        if path is not None:
            self.trees.append(self.tree)
            self.paths.append((path, num_accepted, active))
        return super().commit_begin(num_accepted, next_token, active, target_hidden, path)


def branch_counts(drafter: RecordsTrees) -> tuple[int, int, int]:
    """(accepted nodes, accepted nodes that are not their parent's first child, row-rounds with a rejection)."""
    accepted = later = rejected = 0
    for tree, (path, n, active) in zip(drafter.trees, drafter.paths):
        first_child = tree.children()[..., 0]                                        # (B, N+1)
        parents = torch.nn.functional.pad(tree.parents, (1, 0))                     # (B, N+1)
        for b in active.nonzero().flatten().tolist():
            nodes = path[b, 1: int(n[b]) + 1]
            accepted += len(nodes)
            later += int((first_child[b, parents[b, nodes]] != nodes).sum())
            rejected += int(n[b] < tree.depth[b].max())
    return accepted, later, rejected
