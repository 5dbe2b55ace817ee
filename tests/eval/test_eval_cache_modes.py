"""eval.static_cache and eval.compile reach every decoding call of an evaluation, the cost model's included, and
leave its tokens and acceptance counts unchanged; the run's Models carry the same mode to Draft-OPD rollouts."""
from specdistill.config import EvalConfig
from specdistill.decoding import compiled, kv
from specdistill.eval.evaluator import evaluate


def _cfg(**kw):
    base = dict(gamma=3, max_new_tokens=12, batch_size=2, batch_sizes=[2], warmup_prompts=1, ignore_eos=True,
                measure_cost=True)
    return EvalConfig(**(base | kw))


def test_static_and_compiled_caches_evaluate_the_same_tokens(target, draft, tok, prompts, monkeypatch):
    made = []
    init = kv.BatchKV.__init__

    def recorded(self, model, max_length=None, compile=False, **kwargs):
        made.append((max_length is not None, compile))
        init(self, model, max_length, compile, **kwargs)

    backend = compiled._backend
    monkeypatch.setattr(kv.BatchKV, "__init__", recorded)
    # the switch's plumbing, not inductor: dynamo's eager backend (its tracer and guards, no kernel builds)
    monkeypatch.setattr(compiled, "_backend", lambda name, device, count: backend("eager", device, count))
    growing = evaluate(target, tok, draft, prompts, _cfg(), progress=False)
    assert made and not any(static for static, _ in made)
    for settings, mode in [(dict(static_cache=True), (True, False)), (dict(compile=True), (True, True))]:
        made.clear()
        r = evaluate(target, tok, draft, prompts, _cfg(**settings), progress=False)
        assert set(made) == {mode}, settings  # target-only, speculative (target and draft) and the cost model
        assert [s["text"] for s in r.samples] == [s["text"] for s in growing.samples]
        assert r.accept_len_hist == growing.accept_len_hist and r.greedy_mismatches == 0
        if settings.get("compile"):  # the results say what compiled: every graph once
            stats = r.env["compile_stats"]
            assert stats["target"]["total_compiles"] > 0 and stats["draft"]["total_compiles"] > 0
            assert set(stats["target"]["compiles"].values()) == {1} and stats["target"]["recompiles"] == 0


def test_the_run_passes_its_decoding_mode_to_the_objectives(tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.build import build
    from specdistill.decoding import CacheMode
    from tests.conftest import ONPOLICY_ALONE, compose, tiny_overrides

    cfg = compose("draft_opd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "run", tmp_path / "cache")
                  + ONPOLICY_ALONE + ["eval.compile=true"])
    assert build(cfg).models.decoding == CacheMode(static=False, compile=True)
