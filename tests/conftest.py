"""Shared fixtures: a tiny chat tokenizer, tiny Llama targets saved as HF folders, and small conversation files.

Nothing here touches a network or the embedded real model: everything is built from configs in seconds.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the a cat dog sat on mat ran to park and saw bird tree red blue green one two three four five what is "
         "why how please tell me about color number yes no hello hi thanks").split()


def make_tokenizer(extra_words: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(random.Random(i).choices(WORDS + list(extra_words), k=12)) for i in range(300)]
    tok.train_from_iterator(corpus + ["user assistant system"] * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def make_tiny_lm(vocab_size: int, layers: int = 4, hidden: int = 64, seed: int = 0, max_pos: int = 512):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg)


def noisy_eagle3_head(target, vd: int, seed: int = 0):
    """An EAGLE-3 head for `target` over a random draft vocabulary of `vd` ids, its trainable weights nudged off their
    initialisation (fresh norms are all ones) so that every tensor matters."""
    import torch

    from specdistill.drafts.eagle3.model import build_eagle3

    torch.manual_seed(seed)
    V = target.config.vocab_size
    return nudged(build_eagle3(target, torch.randperm(V)[:vd].sort().values, None))


def nudged(module):
    """`module` with every trainable weight moved by 0.05 x N(0, 1) noise from torch's global generator (fresh norms
    are all ones, so a fresh layer is nearly trivial)."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return module


def left_padded_prompts(lengths: list[int], seed: int = 0, vocab: int = 48):
    """Left-padded (B, T) prompt ids and attention mask for rows of the given lengths (T = the longest; pad id 0,
    real ids drawn uniformly from [3, vocab) by a generator seeded with `seed`)."""
    import torch

    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(T) >= T - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def single_thread():
    """Tiny models are overhead-bound: one thread is faster, and 2 threads on a busy 2-core box crawl (~10x).
    Used as a module-scoped autouse fixture by the decoding/ and eval/ test folders."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def conversations(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for _ in range(r.randint(1, 2)):
            turns.append({"from": "human", "value": " ".join(r.choices(WORDS, k=r.randint(3, 8)))})
            turns.append({"from": "gpt", "value": " ".join(r.choices(WORDS, k=r.randint(4, 12)))})
        rows.append({"id": str(i), "conversations": turns})
    return rows


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_target")
    tok = make_tokenizer()
    model = make_tiny_lm(len(tok))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_data_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "conv.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in conversations(96)))
    return p


def tiny_overrides(target_dir, data_file, out_dir, cache_dir) -> list[str]:
    """Overrides that point any recipe at the tiny target and data and keep runs to seconds."""
    return [f"target.path={target_dir}", "target.dtype=float32", f"data.path={data_file}", "data.format=auto",
            "data.max_rows=null", "data.max_length=64", "data.heldout_size=8", f"data.cache_dir={cache_dir}",
            "draft.num_layers=1", f"trainer.output_dir={out_dir}", "trainer.micro_batch_size=2", "trainer.grad_accum=2",
            "trainer.max_steps=3", "trainer.log_every=1", "trainer.save_every=100", "trainer.eval_every=0",
            "trainer.warmup_steps=1", "eval.max_batches=2", "eval.num_prompts=2", "eval.max_new_tokens=8",
            "eval.spec_eval=false", f"data.regenerate.prompts={data_file}", "data.regenerate.max_prompts=24",
            "data.regenerate.max_new_tokens=12", "data.regenerate.batch_size=8",
            f"data.regenerate.store_dir={Path(cache_dir) / 'regenerated'}",
            "draft.draft_vocab_size=null"]  # the tiny vocabulary is smaller than the recipes' draft vocabularies


# recipe=draft_opd's on-policy phase alone: no warm-up, the data file instead of
# the regenerated store, a standalone LM draft (a later draft=... override still wins), no EAGLE-3 export
ONPOLICY_ALONE = ["warmup.mode=never", "data.regenerate.enabled=false", "draft=from_target",
                  "trainer.export_formats=[]"]


def compose(recipe: str | None, overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specdistill.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=([f"recipe={recipe}"] if recipe else []) + overrides)


def assert_bf16_near_fp32(recipe: str, target_dir, data_file, tmp_path: Path, overrides: list[str]) -> None:
    """Train the same tiny run twice, in fp32 and under bf16 autocast (trainer.mixed_precision=no, bf16): the bf16
    losses are finite, its first step's (same weights, same data and rollout) is within 5% of the fp32 run's, and the
    two differ (autocast really ran). accelerate keeps one process-wide state, fixed by its first Accelerator: it is
    reset before each run and at the end, so later tests find it as a fresh process would."""
    import math

    from accelerate.state import AcceleratorState

    from specdistill.pipeline.run import build_components
    from specdistill.train.loop import fit

    losses = {}
    try:
        for precision in ("no", "bf16"):
            AcceleratorState._reset_state(reset_partial_state=True)
            cfg = compose(recipe, tiny_overrides(target_dir, data_file, tmp_path / precision, tmp_path / "cache")
                          + overrides + [f"trainer.mixed_precision={precision}"])
            c = build_components(cfg)
            assert str(c.accelerator.mixed_precision) == precision
            losses[precision] = [h["train/loss"] for h in fit(c).history]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    fp32, bf16 = losses["no"], losses["bf16"]
    assert len(bf16) == len(fp32) >= 2 and all(math.isfinite(x) for x in bf16)
    assert abs(bf16[0] - fp32[0]) <= 0.05 * abs(fp32[0]), (bf16, fp32)
    assert bf16 != fp32  # autocast really ran


@pytest.fixture
def no_gc():
    """A fresh dynamo, and no cycle collection while the test runs: a compiled decoding call's cache slot comes back
    by its close(), never by the garbage collector."""
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to load a target or tokenizer fails the test: validation and refusals must come first."""
    import specdistill.build as build_mod

    def refuse(cfg):
        raise AssertionError("a model was loaded before the config was validated and refused")
    monkeypatch.setattr(build_mod, "build_target", refuse)
    monkeypatch.setattr(build_mod, "build_tokenizer", refuse)


def compose_tiny(target_dir, data_file, tmp_path, extra=(), recipe="kd"):
    """A recipe composed over the tiny target and data, writing under tmp_path ("o" and "cache")."""
    return compose(recipe, tiny_overrides(target_dir, data_file, tmp_path / "o", tmp_path / "cache") + list(extra))
