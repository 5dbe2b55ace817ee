"""The peers benchmark's scoring choices, without a model: the gammas it scores, the evaluator command (batch size
included), the best gamma per arm from measured speedups, its table in results.md and its refusal at batch > 1."""
from __future__ import annotations

import json

import pytest

from benchmarks.peers.run import (GammaPick, best_gamma_refusal, eval_command, main, pick_best_gamma,
                                  pick_best_gammas, scored_gammas, setting_key, write_report)


def ev(tau: float, speedup) -> dict:
    return {"rc": 0, "tau": tau, "speedup": speedup, "batch_size": 1, "accept_rate_per_pos": [0.7, 0.5, 0.3, 0.2],
            "dir": "/eval"}


# specdistill: tau grows with gamma, the measured speedup peaks at 3; at T=1 it peaks at 2.
OURS = {setting_key(0, 1): ev(1.7, 1.30), setting_key(0, 2): ev(2.2, 1.52), setting_key(0, 3): ev(2.6, 1.61),
        setting_key(0, 4): ev(2.8, 1.58), setting_key(0, 6): ev(3.0, 1.41),
        setting_key(1, 1): ev(1.5, 1.20), setting_key(1, 2): ev(1.9, 1.33), setting_key(1, 3): ev(2.0, 1.25),
        setting_key(1, 4): ev(2.1, 1.10), setting_key(1, 6): ev(2.2, 0.95)}
GAMMAS = [4, 1, 2, 3, 6]


def results_for(batch_size: int = 1) -> dict:
    return {"mode": "tiny", "command": "python -m benchmarks.peers.run --tiny --best-gamma", "budget": "1 epoch(s)",
            "rows": 15, "loss_tokens": 360, "settings": [setting_key(t, g) for t in (0, 1) for g in GAMMAS],
            "eval_batch_size": batch_size, "paired": {}, "arms": {
                "specdistill": {"evals": dict(OURS), "loss_tokens_per_s": 100.0, "wall_s": 3.6},
                # the peer's gamma-3 eval failed and its gamma-6 speedup came back null (NaN): gamma 4 is its best
                "specforge-ours": {"evals": {setting_key(0, 1): ev(1.4, 1.05), setting_key(0, 2): ev(1.8, 1.21),
                                             setting_key(0, 3): {"rc": 1, "error": "boom"},
                                             setting_key(0, 4): ev(2.3, 1.24), setting_key(0, 6): ev(2.5, None)},
                                   "wall_s": 9.0, "conversion": {"exact": True, "agreement_with_peer_forward": 1.0}},
                "modelopt-ours": {"rc": 1, "error": "RuntimeError: boom"}}}


def test_scored_gammas_default_to_4_and_best_gamma_scores_1_to_6_with_4_first():
    assert scored_gammas(None, best_gamma=False) == [4]
    assert scored_gammas(None, best_gamma=True) == [4, 1, 2, 3, 5, 6]
    assert scored_gammas([2, 4, 6], best_gamma=False) == [2, 4, 6]
    assert scored_gammas([2, 4, 6, 2], best_gamma=True) == [4, 2, 6]
    assert scored_gammas([3, 5], best_gamma=True) == [3, 5]


def test_eval_command_carries_the_batch_size_and_composes(tmp_path):
    from tests.conftest import compose

    cmd = eval_command("/models/t", "/heads/h", tmp_path / "e", prompts=80, tokens=128, gamma=5, temperature=0.7,
                       batch_size=4)
    assert cmd[1].endswith("scripts/evaluate.py")
    assert {"eval.batch_size=4", "eval.batch_sizes=[4]", "eval.gamma=5", "eval.temperature=0.7",
            "eval.num_prompts=80", "eval.max_new_tokens=128", "eval.draft_path=/heads/h"} <= set(cmd)
    cfg = compose(None, cmd[2:])  # the overrides name keys that conf/eval has
    assert cfg.eval.batch_size == 4 and list(cfg.eval.batch_sizes) == [4] and cfg.eval.gamma == 5
    assert "eval.batch_size=1" in eval_command("/t", "/h", tmp_path, prompts=2, tokens=8, gamma=4, temperature=0.0,
                                               batch_size=1)


def test_best_gamma_is_the_highest_measured_speedup_not_the_highest_tau():
    assert pick_best_gamma(OURS, 0.0, GAMMAS) == GammaPick(gamma=3, speedup=1.61, tau=2.6)
    assert pick_best_gamma(OURS, 1.0, GAMMAS) == GammaPick(gamma=2, speedup=1.33, tau=1.9)
    assert pick_best_gamma(OURS, 0.0, [4, 6]) == GammaPick(gamma=4, speedup=1.58, tau=2.8)  # only the candidates
    tie = {setting_key(0, 2): ev(2.0, 1.5), setting_key(0, 5): ev(2.9, 1.5)}
    assert pick_best_gamma(tie, 0.0, [5, 2]).gamma == 2  # a tie goes to the shorter gamma
    assert pick_best_gamma({setting_key(0, 4): ev(2.0, float("nan"))}, 0.0, [4]) is None
    assert pick_best_gamma(OURS, 0.5, GAMMAS) is None  # nothing scored at that temperature


def test_pick_best_gammas_records_each_arm_and_temperature():
    results = results_for()
    bg = pick_best_gammas(results, [0.0, 1.0], GAMMAS, batch_size=1)
    assert bg == {"gammas": GAMMAS, "temperatures": [0.0, 1.0], "batch_size": 1, "skipped": None}
    arms = results["arms"]
    assert arms["specdistill"]["best_gamma"] == {"T0": {"gamma": 3, "speedup": 1.61, "tau": 2.6},
                                                 "T1": {"gamma": 2, "speedup": 1.33, "tau": 1.9}}
    assert arms["specforge-ours"]["best_gamma"] == {"T0": {"gamma": 4, "speedup": 1.24, "tau": 2.3}}
    assert arms["modelopt-ours"]["best_gamma"] == {}


def test_report_writes_the_best_gamma_table(tmp_path):
    results = results_for()
    results["best_gamma"] = pick_best_gammas(results, [0.0, 1.0], GAMMAS, batch_size=1)
    write_report(tmp_path, results)
    md = (tmp_path / "results.md").read_text()
    assert "## Best gamma per arm (measured speedup)" in md
    assert "| arm | T | best gamma | speedup | tau | speedup at gamma 1, 2, 3, 4, 6 |" in md
    assert "| specdistill | 0 | 3 | 1.610 | 2.6000 | 1.300, 1.520, 1.610, 1.580, 1.410 |" in md
    assert "| specdistill | 1 | 2 | 1.330 | 1.9000 | 1.200, 1.330, 1.250, 1.100, 0.950 |" in md
    assert "| specforge-ours | 0 | 4 | 1.240 | 2.3000 | 1.050, 1.210, -, 1.240, - |" in md
    assert "| modelopt-ours | 0 | none: no measured speedup | - | - | -, -, -, -, - |" in md
    # the primary table (T0-g4) shows the measured speedup, and the note says speedups compare at batch 1 only
    assert "| specdistill | 2.8000 |" in md and "| yes | 1.580 |" in md
    assert "at eval batch size 1" in md and "speedups are comparable only at batch 1." in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["arms"]["specdistill"]["best_gamma"]["T0"] == {"gamma": 3, "speedup": 1.61, "tau": 2.6}
    assert saved["best_gamma"]["skipped"] is None


def test_best_gamma_is_refused_at_batch_above_1(tmp_path):
    results = results_for(batch_size=4)
    results["best_gamma"] = pick_best_gammas(results, [0.0, 1.0], GAMMAS, batch_size=4)
    assert results["best_gamma"]["skipped"].startswith("the evals ran at batch size 4;")
    assert all("best_gamma" not in rec for rec in results["arms"].values())
    write_report(tmp_path, results)
    md = (tmp_path / "results.md").read_text()
    assert "## Best gamma per arm (measured speedup)\n\nNot picked: the evals ran at batch size 4;" in md
    assert "| best gamma |" not in md
    assert "these ran at batch 4, not what a batch-1 user sees." in md
    assert json.loads((tmp_path / "results.json").read_text())["best_gamma"]["batch_size"] == 4


def test_best_gamma_refusal_reasons():
    assert best_gamma_refusal([4, 1, 2], 1) is None
    assert "batch size 2" in best_gamma_refusal([4, 1, 2], 2)
    assert best_gamma_refusal([4], 1).startswith("only gamma 4 was scored")


def test_eval_batch_size_below_1_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--eval-batch-size", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--eval-batch-size must be at least 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
