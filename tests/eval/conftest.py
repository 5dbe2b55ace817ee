"""Fixtures for the evaluator tests: a tiny chat tokenizer and tiny Llama target/draft built from configs."""
import pytest

from tests.conftest import make_tiny_lm, make_tokenizer, single_thread


one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


@pytest.fixture(scope="session")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="session")
def target(tok):
    return make_tiny_lm(len(tok), layers=2, hidden=64, seed=0).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def draft(tok):
    return make_tiny_lm(len(tok), layers=1, hidden=64, seed=1).eval().requires_grad_(False)


PROMPTS = [[{"role": "user", "content": "tell me about the cat and the dog"}],
           [{"role": "user", "content": "what is one two three"}],
           [{"role": "system", "content": "yes"}, {"role": "user", "content": "hello"}],
           [{"role": "user", "content": "why is the bird red and blue and green"}]]


@pytest.fixture
def prompts():
    return [list(p) for p in PROMPTS]
