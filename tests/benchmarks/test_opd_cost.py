"""python -m benchmarks.opd_cost on tiny models: both arms timed on their own micro-batches, in turn, the ratio is the
ratio of the arms' seconds per trained position, and the files say so; --parts times the on-policy step part by
part, in steps of their own."""
import json

import pytest

from benchmarks import opd_cost
from benchmarks.opd_cost import main
from tests.conftest import tiny_overrides


@pytest.mark.filterwarnings("ignore")
def test_opd_cost_smoke(tiny_target_dir, tiny_data_file, tmp_path, monkeypatch):
    shared = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "run", tmp_path / "cache")
    shared += ["trainer.grad_accum=1"]
    from specdistill.decoding.kv import BatchKV
    from specdistill.drafts.eagle3 import Eagle3Drafter
    before = (BatchKV.step, Eagle3Drafter.propose)
    order = []
    timed_step = opd_cost.Arm.timed_step
    monkeypatch.setattr(opd_cost.Arm, "timed_step", lambda arm, s: (order.append((arm.recipe, s)), timed_step(arm, s)))
    res = main(["--steps", "2", "--parts", "1", "--out", str(tmp_path / "cost"), "--offpolicy", "objective.steps=2",
                "--onpolicy", "draft=eagle3", "--onpolicy", "objective.max_new_tokens=6"] + shared)
    on, off = res["arms"]["onpolicy"], res["arms"]["offpolicy"]
    assert (on["recipe"], off["recipe"]) == ("draft_opd", "eagle3") and "draft=eagle3" in on["overrides"]
    # the arms take their timed steps in turn
    assert order == [("draft_opd", 1), ("eagle3", 1), ("draft_opd", 2), ("eagle3", 2)]
    for arm in (on, off):
        assert arm["steps"] == 2 and arm["positions_per_step"] > 0 and arm["seconds_per_step"] > 0
        assert arm["seconds_per_position"] == pytest.approx(arm["seconds_per_step"] / arm["positions_per_step"])
        assert 0 <= arm["prepare_seconds_per_step"] <= arm["seconds_per_step"]
    # the on-policy step's target work is its rollout: prefill + one verify forward per round, per micro-batch
    assert on["target_forwards_per_step"] >= 2 and on["target_tokens_per_step"] > 0
    assert res["ratio_seconds_per_position"] == pytest.approx(on["seconds_per_position"] / off["seconds_per_position"])
    # the step ratio at equal rows: both arms take the same micro-batches here
    assert on["rows_per_step"] == off["rows_per_step"] > 0
    assert res["ratio_seconds_per_step_equal_rows"] == pytest.approx(on["seconds_per_step"] / off["seconds_per_step"])
    saved = json.loads((tmp_path / "cost" / "opd_cost.json").read_text())
    assert saved["ratio_seconds_per_position"] == pytest.approx(res["ratio_seconds_per_position"])
    md = (tmp_path / "cost" / "opd_cost.md").read_text()
    assert "| onpolicy | draft_opd |" in md and "| offpolicy | eagle3 |" in md
    assert f"trained position: **{res['ratio_seconds_per_position']:.2f}x**" in md
    assert "goal" not in md  # figures, not verdicts against a goal kept in code
    # --parts: the on-policy step part by part, its parts and rests adding up to the step; the off-policy arm has none
    parts = on["parts"]
    assert off["parts"] == {} and parts["step"] > 0
    assert parts["target verify forwards"] > 0 and parts["draft proposals"] > 0 and parts["prefills"] > 0
    assert parts["verification"] > 0 and parts["rounds to positions"] > 0 and parts["loss backward"] > 0
    assert sum(v for k, v in parts.items() if k != "step") == pytest.approx(parts["step"])
    assert parts["rest of the rollout"] >= 0 and parts["rest of the step"] >= 0
    assert "| target verify forwards |" in md
    assert (BatchKV.step, Eagle3Drafter.propose) == before  # the timers are gone again


@pytest.mark.filterwarnings("ignore")
def test_compiled_rollouts_count_their_target_forwards(tiny_target_dir, tiny_data_file, tmp_path, monkeypatch):
    """Compiled decode steps replay graphs, which run no module hooks: the arm counts them at the compiled cache, so
    a rollout on eval.compile=true reports the eager rollout's target forwards and tokens (T=0: the same rounds)."""
    from specdistill.decoding import compiled
    backend = compiled._backend  # dynamo's eager backend: the compiled path's plumbing without kernel builds
    monkeypatch.setattr(compiled, "_backend", lambda name, device, count: backend("eager", device, count))
    fed = {}
    for mode in ("false", "true"):
        shared = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / f"run_{mode}", tmp_path / "cache")
        shared += ["trainer.grad_accum=1"]
        res = main(["--steps", "1", "--out", str(tmp_path / f"cost_{mode}"), "--offpolicy", "objective.steps=2",
                    "--onpolicy", "draft=eagle3", "--onpolicy", "objective.max_new_tokens=6", "--onpolicy",
                    "objective.temperature=0", "--onpolicy", f"eval.compile={mode}"] + shared)
        on = res["arms"]["onpolicy"]
        fed[mode] = (on["target_forwards_per_step"], on["target_tokens_per_step"])
    assert fed["true"] == fed["false"] and fed["true"][0] >= 3  # the prefill and at least two rounds
