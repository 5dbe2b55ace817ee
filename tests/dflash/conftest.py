"""Fixtures for the DFlash tests: a tiny Llama target with peaked distributions, DFlash drafts built on it, left-padded
prompts. Everything is built from configs in well under a second."""

import pytest
import torch

from specdistill.drafts.dflash import build_dflash
from tests.conftest import make_tiny_lm, single_thread

V = 48

one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


def tiny_target(sharpen: float = 4.0, layers: int = 4):
    target = make_tiny_lm(V, layers=layers, hidden=32, seed=0).eval()
    target.lm_head.weight.data.mul_(sharpen)  # HF init gives near-uniform p; sharpen for peaked distributions
    return target


def tiny_dflash(target, block_size: int, seed: int = 0, num_layers: int = 1, **kw):
    torch.manual_seed(seed)
    draft = build_dflash(target, num_layers, block_size, None, None, **kw)
    for p in draft.parameters():  # make the layers non-trivial (fresh norms are all-ones)
        if p.requires_grad:
            p.data.add_(0.05 * torch.randn_like(p))
    return draft.eval()


def prompts(lengths, seed=0, vocab=V):
    """Left-padded (B, T) prompts of the given lengths (pad id 0)."""
    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(T) >= T - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@pytest.fixture
def chi_square_pvalue():
    from tests.decoding.conftest import _chi_square_pvalue

    return _chi_square_pvalue
