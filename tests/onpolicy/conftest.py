"""Fixtures for the on-policy tests: seeded tiny Llama target/draft pairs built from configs, ragged prompts."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.models.target import Target

from tests.conftest import left_padded_prompts, single_thread

one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


def tiny_lm(seed: int = 0, vocab: int = 48, layers: int = 2, init_std: float = 0.2) -> LlamaForCausalLM:
    # init_std 0.2 makes distributions peaked and two seeds disagree often: every category shows up.
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                         initializer_range=init_std, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(0), tiny_lm(1, layers=1)


@pytest.fixture
def ragged_prompts():
    """Left-padded (3, 7) prompts of lengths 7, 3, 5 (pad id 0), seeded."""
    return left_padded_prompts([7, 3, 5], seed=7)


class CountingTarget(Target):
    """A Target that counts the forwards of its model (replay must never run the target again)."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = 0
        self._hook = model.register_forward_hook(lambda *a: setattr(self, "calls", self.calls + 1))

    def detach_counter(self) -> None:
        self._hook.remove()


def perturb(module: torch.nn.Module, scale: float = 0.05) -> None:
    """Move every trainable parameter a little (the draft changes between two calls)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))
