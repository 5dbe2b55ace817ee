"""Every stage of a run resumes: a run killed in its final evaluation or in its export, then resumed with
trainer.resume=auto, ends with the files of an uninterrupted run; a finished run with every stage recorded rewrites
nothing."""
import json

import pytest

import specdistill.pipeline.run as pipeline
from tests.conftest import compose, tiny_overrides

TIMING = ("seconds", "tokens_per_s", "latency", "prefill", "speedup", "cost", "round_cost", "env", "hf", "batch_sweep",
          "predicted")


def _cfg(tiny_target_dir, tiny_data_file, root, out, extra=()):
    return compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, root / out, root / "cache") + [
        "trainer.max_steps=2", "eval.spec_eval=true", "eval.spec_eval_at=end", "eval.num_prompts=2",
        "eval.max_new_tokens=6", f"eval.prompts={tiny_data_file}", "eval.gamma=2", "eval.warmup_prompts=0",
        "eval.measure_cost=false", "trainer.export_formats=[vllm,sglang]", *extra])


def _files(out) -> dict:
    """What the stages after training wrote, without wall-clock figures (they differ between any two runs)."""
    res = json.loads((out / "eval" / "final" / "results.json").read_text())
    res = {k: v for k, v in res.items() if not any(t in k for t in TIMING)}
    got = {"eval/final/results.json": res,
           "eval/final/outputs.jsonl": (out / "eval" / "final" / "outputs.jsonl").read_text()}
    for fmt in ("vllm", "sglang"):
        for name in ("config.json", "model.safetensors"):
            got[f"export/{fmt}/{name}"] = (out / "export" / fmt / name).read_bytes()
    return got


@pytest.fixture(scope="module")
def whole(tiny_target_dir, tiny_data_file, tmp_path_factory):
    """An uninterrupted run's folder (shared by the tests of this module)."""
    root = tmp_path_factory.mktemp("whole")
    pipeline.run(_cfg(tiny_target_dir, tiny_data_file, root, "run"))
    return root / "run"


class Killed(BaseException):
    """Stands for SIGKILL / SIGTERM's default action: nothing after it runs (not even `except Exception`)."""


@pytest.mark.parametrize("stage", ["eval/final", "export/sglang"])
def test_a_run_killed_after_training_finishes_its_stages_on_resume(stage, whole, tiny_target_dir, tiny_data_file,
                                                                   tmp_path, monkeypatch):
    real_eval, real_export = pipeline.final_spec_eval, pipeline.export_final
    out = tmp_path / "killed"

    def killed_eval(c, epoch, step):
        (out / "eval" / "final").mkdir(parents=True, exist_ok=True)
        (out / "eval" / "final" / "results.json").write_text('{"mean_accept_len": ')  # half written
        raise Killed()

    def killed_export(cfg, checkpoint, output_dir, formats=None, log=print):
        if formats == ["sglang"]:
            (out / "export" / "sglang").mkdir(parents=True)
            (out / "export" / "sglang" / "config.json").write_text("{")
            raise Killed()
        return real_export(cfg, checkpoint, output_dir, formats, log)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "final_spec_eval", killed_eval if stage == "eval/final" else real_eval)
        m.setattr(pipeline, "export_final", killed_export)
        with pytest.raises(Killed):
            pipeline.run(_cfg(tiny_target_dir, tiny_data_file, tmp_path, "killed"))
    assert stage not in pipeline.read_stages(out)

    res = pipeline.run(_cfg(tiny_target_dir, tiny_data_file, tmp_path, "killed", ["trainer.resume=auto"]))
    assert res.nothing_to_do and res.step == 2
    assert _files(out) == _files(whole)
    assert set(pipeline.read_stages(out)) == {"eval/final", "export/vllm", "export/sglang"}


@pytest.mark.parametrize("recorded", [True, False])
def test_a_finished_run_with_every_stage_complete_rewrites_nothing(recorded, whole, tiny_target_dir, tiny_data_file,
                                                                   monkeypatch):
    """Whether stages.json records the stages or (a folder written before it existed) their folders are complete."""
    out = whole
    if not recorded:
        (out / "stages.json").unlink()
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}

    def must_not_run(*a, **k):
        raise AssertionError("a recorded stage ran again")

    monkeypatch.setattr(pipeline, "final_spec_eval", must_not_run)
    monkeypatch.setattr(pipeline, "export_final", must_not_run)
    res = pipeline.run(_cfg(tiny_target_dir, tiny_data_file, out.parent, "run", ["trainer.resume=auto"]))
    assert res.nothing_to_do
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
