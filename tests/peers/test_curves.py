"""benchmarks.peers.curves: points merged across runs, refused when the runs were scored differently."""
from __future__ import annotations

import json

import pytest

from benchmarks.peers import curves


def eval_cmd(prompts=40, gamma=4, temperature=0.0, batch=8) -> str:
    return (f"python scripts/evaluate.py target=local eval.draft_path=/x eval.num_prompts={prompts} "
            f"eval.max_new_tokens=128 eval.gamma={gamma} eval.temperature={temperature} eval.batch_size={batch} "
            f"eval.batch_sizes=[{batch}] eval.output_dir=/y")


def run(arms: dict, setting="T0-g4", **cmd) -> dict:
    """A results.json with arms {name: (loss_tokens, wall_s, tau)}."""
    return {"settings": [setting],
            "arms": {n: {"loss_tokens": t, "wall_s": s, "evals": {setting: {"tau": tau, "command": eval_cmd(**cmd)}}}
                     for n, (t, s, tau) in arms.items()},
            "paired": {setting: {"overall": {n: {"tau_ci95": [tau - 0.01, tau + 0.01]} for n, (_, _, tau) in
                                             arms.items()}}}}


def test_points_merge_per_arm_sorted_by_tokens_and_a_reused_head_counts_once():
    cut = run({"specdistill": (100, 50.0, 1.2), "specforge-defaults": (60, 50.0, 1.1)})
    full = run({"specdistill": (100, 50.0, 1.2), "specforge-defaults": (100, 80.0, 1.15)})
    setting, c = curves.merge({"full": full, "cut": cut})
    assert setting == "T0-g4"
    assert [(p.run, p.loss_tokens, p.tau) for p in c["specforge-defaults"]] == [("cut", 60, 1.1), ("full", 100, 1.15)]
    assert len(c["specdistill"]) == 1
    assert c["specforge-defaults"][0].tau_lo == pytest.approx(1.09)


def test_runs_scored_on_other_prompts_are_refused_by_name():
    with pytest.raises(SystemExit, match="eval.num_prompts"):
        curves.merge({"a": run({"x": (1, 1.0, 1.1)}), "b": run({"x": (2, 2.0, 1.2)}, prompts=80)})


def test_a_setting_one_run_did_not_score_is_refused():
    with pytest.raises(SystemExit, match="did not score T1-g4"):
        curves.merge({"a": run({"x": (1, 1.0, 1.1)}), "b": run({"x": (2, 2.0, 1.2)}, setting="T1-g4",
                                                                temperature=1.0)}, setting="T1-g4")
    with pytest.raises(SystemExit, match="primary settings differ"):
        curves.merge({"a": run({"x": (1, 1.0, 1.1)}), "b": run({"x": (2, 2.0, 1.2)}, setting="T1-g4")})


def test_unscored_or_failed_arms_give_no_point():
    r = run({"x": (1, 1.0, 1.1)})
    r["arms"]["broken"] = {"loss_tokens": 5, "wall_s": 3.0, "evals": {"T0-g4": {"rc": 1, "error": "boom"}}}
    _, c = curves.merge({"a": r})
    assert set(c) == {"x"}


def test_cli_writes_json_markdown_and_plot(tmp_path):
    for name, arms in (("cut", {"specforge-defaults": (60, 50.0, 1.1)}), ("full", {"specforge-defaults":
                                                                                   (100, 80.0, 1.15)})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(run(arms)))
    out = tmp_path / "curves"
    curves.main([str(tmp_path / "cut"), str(tmp_path / "full"), "--out", str(out)])
    saved = json.loads((out / "curves.json").read_text())
    assert [p["loss_tokens"] for p in saved["curves"]["specforge-defaults"]] == [60, 100]
    md = (out / "curves.md").read_text()
    assert "benchmarks.peers.curves" in md and "| specforge-defaults |" in md and "1.150 [1.140, 1.160]" in md
    assert (out / "curves.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no results.json"):
        curves.main([str(tmp_path), "--out", str(out)])
