"""Draft-OPD rollouts (LM drafts, EAGLE-3 heads, token trees) and regeneration decode on the compiled fixed-shape
path (CacheMode(compile=True), dynamo's eager backend: its tracer and guards without kernel builds): the same tokens
as the growing caches, every graph compiled once, and a second call of the same buckets compiles nothing, the first
call's rollout still referenced."""

import pytest
import torch
from safetensors.torch import load_file

from specdistill.config import RegenerateConfig
from specdistill.data.regenerated import part_path
from specdistill.decoding import CacheMode, TreeShape, compile_stats
from specdistill.onpolicy.rollout import collect_rollout
from specdistill.pipeline.regenerate import regenerate_store
from tests.conftest import left_padded_prompts, make_tiny_lm, make_tokenizer, noisy_eagle3_head
from tests.onpolicy.conftest import tiny_lm

COMPILED = CacheMode(compile=True, backend="eager")
V = 48


def _same_positions(a, b) -> None:
    assert [r.tolist() for r in a.rows] == [r.tolist() for r in b.rows]
    for name in ("row", "context_len", "token", "category", "accepted", "index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.allclose(a.target.dense(), b.target.dense(), atol=1e-4)
    if a.aux is not None:
        assert torch.allclose(a.aux, b.aux, atol=1e-4)


def _graphs_once(*models) -> dict:
    compiles = {}
    for model in models:
        stats = compile_stats(model)
        assert stats.total_compiles > 0 and set(stats.compiles.values()) == {1}, stats.compiles
        assert not any(name.endswith("_slot1") for name in stats.compiles), stats.compiles
        compiles[model] = dict(stats.compiles)
    return compiles


@torch.no_grad()
@pytest.mark.parametrize("draft_kind, tree", [("lm", None), ("lm", TreeShape(topk=2, depth=2)), ("eagle3", None)])
def test_rollouts_decode_compiled_the_growing_caches_tokens_and_compile_once(draft_kind, tree, no_gc):
    if draft_kind == "lm":
        target, draft = tiny_lm(0), tiny_lm(1, layers=1)
        compiled_models = (target, draft)
    else:
        target = make_tiny_lm(V, layers=4, hidden=32, seed=0).eval()
        draft = noisy_eagle3_head(target, V, 0).eval()
        compiled_models = (target,)  # the head keeps its own one-layer cache
    ids, mask = left_padded_prompts([7, 3, 5], seed=1, vocab=V)

    def rollout(cache):
        return collect_rollout(target, draft, ids, mask, gamma=3, max_new_tokens=10, temperature=0.0, cache=cache,
                               tree=tree)

    first = rollout(COMPILED)
    _same_positions(first, rollout(None))
    warm = _graphs_once(*compiled_models)
    second = rollout(COMPILED)  # `first` is still referenced
    assert _graphs_once(*compiled_models) == warm, "the second rollout compiled"
    _same_positions(second, first)


def _cfg(data_file, store, **kw):
    return RegenerateConfig(**dict(enabled=True, prompts=str(data_file), max_prompts=12, max_new_tokens=6, batch_size=4,
                                   store_dir=str(store)) | kw)


@torch.no_grad()
def test_regeneration_decodes_compiled_the_growing_caches_answers(tiny_data_file, tmp_path, no_gc):
    """Every part (batch 4: one bucket) is answered on the same graphs, compiled once; the stored answers are the
    growing caches' and the features agree to their storage dtype's rounding."""
    tok = make_tokenizer()
    model = make_tiny_lm(len(tok), layers=4).eval()
    quiet = dict(log=lambda *_: None, progress=False)
    root_c, parts = regenerate_store(_cfg(tiny_data_file, tmp_path / "compiled"), model, tok, "tiny", [1, 2, 3],
                                     cache=COMPILED, **quiet)
    root_g, parts_g = regenerate_store(_cfg(tiny_data_file, tmp_path / "growing"), model, tok, "tiny", [1, 2, 3],
                                       **quiet)
    assert parts == parts_g == 3
    for i in range(parts):
        c, g = load_file(str(part_path(root_c, i))), load_file(str(part_path(root_g, i)))
        assert c.keys() == g.keys()
        for key in c:
            if c[key].is_floating_point():
                # stored in bf16: one rounding step apart at most
                torch.testing.assert_close(c[key].float(), g[key].float(), atol=1e-3, rtol=1.6e-2)
            else:
                assert torch.equal(c[key], g[key]), key
    stats = compile_stats(model)
    assert set(stats.compiles.values()) == {1} and len(stats.by_bucket()) == 1, stats.compiles
    assert stats.total_calls >= parts * 5  # the parts' decode steps replayed the one graph
