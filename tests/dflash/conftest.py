"""Fixtures for the DFlash tests: a tiny Llama target with peaked distributions and DFlash drafts built on it (prompts:
tests/conftest.py's left_padded_prompts). Everything is built from configs in well under a second."""

import pytest
import torch

from specdistill.drafts.dflash import build_dflash
from tests.conftest import make_tiny_lm, nudged, single_thread

V = 48

one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


def tiny_target(sharpen: float = 4.0, layers: int = 4):
    target = make_tiny_lm(V, layers=layers, hidden=32, seed=0).eval()
    target.lm_head.weight.data.mul_(sharpen)  # HF init gives near-uniform p; sharpen for peaked distributions
    return target


def tiny_dflash(target, block_size: int, seed: int = 0, num_layers: int = 1, **kw):
    torch.manual_seed(seed)
    return nudged(build_dflash(target, num_layers, block_size, None, None, **kw)).eval()


@pytest.fixture
def chi_square_pvalue():
    from tests.decoding.conftest import _chi_square_pvalue

    return _chi_square_pvalue
