"""Cached stages of the peers benchmark: a finished arm or evaluation is reused only while its inputs are the same."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.peers import run


def finished_arm(tmp_path, spec, inputs):
    arm = tmp_path / "arm"
    (arm / "head").mkdir(parents=True)
    (arm / "train_report.json").write_text("{}")
    (arm / "done.json").write_text(json.dumps({"spec": spec, "inputs": inputs, "process_s": 3.0}))
    return arm


def test_an_arm_is_reused_only_with_the_same_spec_and_inputs(tmp_path):
    spec, inputs = {"peer": "modelopt", "epochs": 1}, {"peer_train": "abc", "shims": {}, "data": "d"}
    arm = finished_arm(tmp_path, spec, inputs)
    assert run.arm_is_done(arm, spec, inputs)
    assert not run.arm_is_done(arm, {**spec, "epochs": 2}, inputs)
    assert not run.arm_is_done(arm, spec, {**inputs, "data": "other store"})
    (arm / "train_report.json").unlink()
    assert not run.arm_is_done(arm, spec, inputs)


def test_file_digest_follows_the_bytes(tmp_path):
    f = tmp_path / "w"
    f.write_bytes(b"a" * 10)
    d = run.file_digest(f)
    assert d == run.file_digest(f) and len(d) == 64
    f.write_bytes(b"a" * 9 + b"b")
    assert run.file_digest(f) != d


def test_an_evaluation_is_reused_until_the_export_or_a_setting_changes(tmp_path, monkeypatch):
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights-1")
    calls = []

    def fake_run(cmd, logfile, threads, timeout=None):
        calls.append(cmd)
        out = next(c.split("=", 1)[1] for c in cmd if c.startswith("eval.output_dir="))
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        (tmp_path / out / "results.json").write_text(json.dumps(
            {"mean_accept_len": 1.5 + len(calls), "accept_rate_per_pos": [0.3], "speedup": 1.0}))
        return 0, 1.0

    monkeypatch.setattr(run, "run_logged", fake_run)
    a = SimpleNamespace(eval_prompts=2, eval_tokens=8, eval_batch_size=1, threads=1)
    out = tmp_path / "o"
    first = run.evaluate(a, "arm", str(export), "t", out, 0.0, 4)
    again = run.evaluate(a, "arm", str(export), "t", out, 0.0, 4)
    assert len(calls) == 1 and again["tau"] == first["tau"]
    run.evaluate(a, "arm", str(export), "t", out, 0.0, 4, prompts=3)  # another setting: evaluated again
    assert len(calls) == 2
    (export / "model.safetensors").write_bytes(b"weights-2")  # the arm was retrained: evaluated again
    changed = run.evaluate(a, "arm", str(export), "t", out, 0.0, 4, prompts=3)
    assert len(calls) == 3 and changed["tau"] != first["tau"]


def test_variant_names_are_safe_folder_and_hydra_values():
    assert run.variant_name(["trainer.optimizer=muon"]) == "specdistill_optimizer_muon"
    assert run.variant_name(["objective.steps=7", "objective.decay=0.8"]) == "specdistill_steps_7_decay_0.8"
    assert run.variant_name(["draft.extra=[1,2]"]) == "specdistill_extra__1_2_"
    assert run.is_ours("specdistill_optimizer_muon") and run.is_ours("specdistill")
    assert not run.is_ours("speculators-defaults")
    with pytest.raises(SystemExit, match="key=value"):
        run.variant_name(["muon"])


def test_a_variant_trains_our_recipe_with_its_overrides_last(tmp_path, monkeypatch):
    """train_ours runs train.py recipe=eagle3_serve with the variant's overrides after the benchmark's own, in the
    variant's own folder and log."""
    seen = []

    def fake_run(cmd, logfile, threads, timeout=None):
        seen.append((cmd, logfile))
        run_dir = tmp_path / "arms" / "specdistill_optimizer_muon"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"wall_s": 10.0, "step": 3}))
        (run_dir / "data_report.json").write_text(json.dumps({"source": "regenerated:/store", "heldout_examples": 2}))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "tokens_seen": 100, "wall_s": 10.0}) + "\n")
        return 0, 11.0

    monkeypatch.setattr(run, "run_logged", fake_run)
    a = SimpleNamespace(epochs=1, prompts=8, wall_seconds=None, tiny=False, threads=1)
    rec = run.train_ours(a, "/t", run.HeadShape(), tmp_path, name="specdistill_optimizer_muon",
                         variant=("trainer.optimizer=muon",))
    cmd, logfile = seen[0]
    assert cmd[-1] == "trainer.optimizer=muon" and "recipe=eagle3_serve" in cmd
    assert f"trainer.output_dir={tmp_path / 'arms' / 'specdistill_optimizer_muon'}" in cmd
    assert logfile.name == "specdistill_optimizer_muon.log"
    assert rec["store"] == "/store" and rec["loss_tokens"] == 100
    # the arms' shared batch and warm-up are passed, not left to the recipe's defaults; a variant's own value wins
    assert f"trainer.micro_batch_size={run.arms.OURS.rows_per_step}" in cmd
    assert f"trainer.warmup_steps={run.arms.OURS.warmup_steps}" in cmd
    seen.clear()
    (tmp_path / "arms" / "specdistill_optimizer_muon").rename(tmp_path / "old")
    run.train_ours(a, "/t", run.HeadShape(), tmp_path, name="specdistill_optimizer_muon",
                   variant=("trainer.micro_batch_size=1",))
    batch = [c for c in seen[0][0] if c.startswith("trainer.micro_batch_size=")]
    assert batch == ["trainer.micro_batch_size=1"]


def test_an_arm_with_tuples_in_its_spec_is_reused(tmp_path):
    """A spec holds tuples (dataclass settings, aux ids); done.json reads them back as lists: still the same arm."""
    import json

    from benchmarks.peers.run import arm_is_done

    spec, inputs = {"settings": {"betas": (0.9, 0.999)}, "peer_aux_ids": (1, 14, 26)}, {"peer_train": "abc"}
    (tmp_path / "train_report.json").write_text("{}")
    (tmp_path / "head").mkdir()
    (tmp_path / "done.json").write_text(json.dumps({"spec": spec, "inputs": inputs, "process_s": 1.0}))
    assert arm_is_done(tmp_path, spec, inputs)
    assert not arm_is_done(tmp_path, {**spec, "peer_aux_ids": (2, 15, 27)}, inputs)


def test_a_vllm_run_is_reused_until_the_export_or_the_evaluation_changes(tmp_path, monkeypatch):
    """serve_in_vllm serves one head per trainer; a second call with the same export and our evaluation reuses the
    engine's result, a retrained head serves again."""
    export, eval_dir = tmp_path / "export", tmp_path / "eval"
    export.mkdir()
    eval_dir.mkdir()
    (export / "model.safetensors").write_bytes(b"weights-1")
    (eval_dir / "results.json").write_text(json.dumps({"mean_accept_len": 1.2}))
    calls = []

    def fake_run(cmd, logfile, threads, timeout=None):
        calls.append(cmd)
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"mean_accept_len": 1.0 + len(calls)}))
        return 0, 2.0

    monkeypatch.setattr(run, "run_logged", fake_run)
    monkeypatch.setattr(run, "arm_export", lambda name, rec: str(export))
    a = SimpleNamespace(vllm_python="/py", eval_prompts=2, eval_tokens=8, gammas=[4], threads=1)

    def serve():
        results = {"settings": ["T0-g4"], "arms": {"specdistill": {"evals": {"T0-g4": {"dir": str(eval_dir),
                                                                                       "tau": 1.2}}}}}
        run.serve_in_vllm(a, results, "t", tmp_path / "o")
        return results["arms"]["specdistill"]["vllm"]

    first = serve()
    assert len(calls) == 1 and first["tau"] == 2.0 and first["ours_tau"] == 1.2
    assert serve()["tau"] == 2.0 and len(calls) == 1
    (export / "model.safetensors").write_bytes(b"weights-2")
    assert serve()["tau"] == 3.0 and len(calls) == 2


def test_a_failed_rerun_leaves_neither_the_stale_result_nor_a_done_record(tmp_path, monkeypatch):
    """run_or_reuse: a result made from other inputs is never read back, even when the run that should replace it
    fails or writes nothing."""
    result, done, outcomes = tmp_path / "r.json", tmp_path / "r.inputs.json", []

    def fake_run(cmd, logfile, threads, timeout=None):
        rc, writes = outcomes.pop(0)
        if writes:
            result.write_text("{}")
        return rc, 1.0

    monkeypatch.setattr(run, "run_logged", fake_run)

    def call(inputs):
        return run.run_or_reuse(["x"], inputs, result, tmp_path / "log", 1, done=done, wall_key="s")

    outcomes[:] = [(0, True)]
    assert call({"v": 1}) == run.Ran(0, 1.0, reused=False) and done.exists()
    assert call({"v": 1}).reused
    outcomes[:] = [(1, False)]
    assert call({"v": 2}).rc == 1 and not result.exists() and not done.exists()
    outcomes[:] = [(0, False)]  # exits 0 but writes no result: nothing to reuse next time
    assert call({"v": 2}).rc == 0 and not done.exists()
    outcomes[:] = [(0, True)]
    assert not call({"v": 2}).reused and call({"v": 2}).reused
