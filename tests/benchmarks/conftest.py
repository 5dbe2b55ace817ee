"""The tiny MoE targets of tests/moe/, for the MoE bench's smoke run."""
from tests.moe.conftest import moe_tokenizer, tiny_moe_dirs  # noqa: F401 (fixtures)
