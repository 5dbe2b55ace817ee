"""scripts/learning_curves.py on synthetic run folders: what the trainer logs comes back in the JSON, the table and the
plot, for several runs at once."""
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "learning_curves.py"


@pytest.fixture(scope="module")
def lc():
    spec = importlib.util.spec_from_file_location("learning_curves", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


def _held(tau: float, rates: list[float]) -> dict:
    return {"heldout/gamma": len(rates), "heldout/accept_rate_per_pos": rates, "heldout/mean_accept_len": tau,
            "heldout/top1_agreement": rates[0], "heldout/num_positions": 75}


def _run(root: Path, name: str, init: str, objective: str, evals: list[tuple], final: dict = None) -> Path:
    """A run folder as the trainer writes it. evals: (step, tokens_seen, wall_s, phase, tau, rates) per held-out
    evaluation; each is logged after its step's train line, as the loop does."""
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(f"run_name: {name}\ndraft:\n  init: {init}\nobjective:\n  name: {objective}\n")
    lines = []
    for step, tokens, wall, phase, tau, rates in evals:
        lines.append({"step": step, "train/loss": 2.0, "tokens_seen": tokens, "wall_s": wall, "phase": phase})
        lines.append({"step": step, "phase": phase, **_held(tau, rates)})
    lines.append({"step": evals[-1][0] + 1, "train/loss": 1.5, "tokens_seen": evals[-1][1] + 10, "wall_s": 99.0})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines) + "\n")
    (run / "summary.json").write_text(json.dumps({
        "step": evals[-1][0] + 1, "heldout_before": _held(1.05, [0.05, 0.0]),
        "heldout_after": _held(evals[-1][4], evals[-1][5]), "wall_s": 100.0}))
    if final is not None:
        (run / "eval" / "final").mkdir(parents=True)
        (run / "eval" / "final" / "results.json").write_text(json.dumps(final))
    return run


def test_runs_round_trip_into_json_table_and_plot(lc, tmp_path):
    a = _run(tmp_path, "head", "eagle3", "eagle3",
             [(2, 100, 10.0, "main", 1.4, [0.3, 0.33]), (4, 200, 20.0, "main", 1.8, [0.6, 0.5])],
             final={"mean_accept_len": 2.25, "speedup": 1.7, "gamma": 3, "temperature": 0.0, "num_prompts": 8})
    b = _run(tmp_path, "opd", "dflash", "draft_opd",
             [(3, 90, 12.0, "warmup", 1.2, [0.2, 0.0]), (6, 300, 130.0, "main", 1.5, [0.4, 0.25])],
             final={"mean_accept_len": 1.6, "speedup": None, "gamma": 3, "temperature": 1.0, "num_prompts": 8})
    out = tmp_path / "curves"
    argv = [str(a), str(b), "--out", str(out), "--label", f"{a}=EAGLE-3 head"]
    assert lc.main(argv) == 0
    data = json.loads((out / "learning_curves.json").read_text())
    assert data["command"] == "python scripts/learning_curves.py " + shlex.join(argv)  # pastes back into a shell
    runs = {r["run_name"]: r for r in data["runs"]}
    head, opd = runs["head"], runs["opd"]
    assert head["label"] == "EAGLE-3 head" and opd["label"] == "opd (dflash / draft_opd)"
    assert (head["draft_kind"], opd["draft_kind"], opd["objective"]) == ("eagle3", "dflash", "draft_opd")
    # the untrained draft at 0 tokens / 0 s, then each held-out evaluation at its step's tokens and wall clock
    assert [(p["step"], p["tokens_seen"], p["wall_s"], p["heldout_tau"], p["phase"]) for p in opd["points"]] == [
        (0, 0, 0.0, 1.05, "before"), (3, 90, 12.0, 1.2, "warmup"), (6, 300, 130.0, 1.5, "main")]
    assert lc.hand_overs(lc.read_run(b).points) == [1] and lc.hand_overs(lc.read_run(a).points) == []
    assert head["points"][-1]["accept_rate_per_pos"] == [0.6, 0.5] and head["heldout_gamma"] == 2
    assert (head["train_wall_s"], head["tokens_seen"], head["steps"], head["final_heldout_tau"]) == (100.0, 210, 5, 1.8)
    assert head["final_eval"]["tau"] == 2.25 and head["final_eval"]["speedup"] == 1.7
    assert opd["final_eval"]["speedup"] is None and opd["final_eval"]["temperature"] == 1.0
    # the written JSON reads back into the same curves
    assert lc.load(out / "learning_curves.json") == [lc.read_run(a, "EAGLE-3 head"), lc.read_run(b)]
    md = (out / "learning_curves.md").read_text()
    assert data["command"] in md
    row = "| EAGLE-3 head | eagle3 | eagle3 | eagle3 | 100.0 s | 210 | 1.800 | 2.250 (gamma 3, T 0, 8 prompts) | 1.700"
    assert row in md
    assert "| opd (dflash / draft_opd) | dflash | dflash | draft_opd | 100.0 s | 310 | 1.500 | 1.600 " in md
    assert (out / "learning_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_evaluations_or_config_is_said(lc, tmp_path, capsys):
    run = _run(tmp_path, "quiet", "from_target", "kd", [(2, 100, 10.0, "main", 1.3, [0.3, 0.0])])
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines if "heldout/gamma" not in m))
    (run / "summary.json").write_text(json.dumps({"step": 3, "wall_s": 5.0}))
    assert lc.main([str(run), "--out", str(tmp_path / "c")]) == 0
    assert "logged no held-out evaluation" in capsys.readouterr().err
    r = json.loads((tmp_path / "c" / "learning_curves.json").read_text())["runs"][0]
    assert r["points"] == [] and r["draft_kind"] == "draft" and r["final_eval"] is None  # a standalone LM draft
    assert lc.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "d")]) == 2
    assert "config.yaml not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lc.main([str(run), "--out", str(tmp_path / "e"), "--label", "elsewhere=x"])
