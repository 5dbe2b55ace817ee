"""The MoE expert-selection bench (benchmarks/moe.py): a smoke run of every arm on a tiny Mixtral with
tiny budgets, and the pure scoring (paired intervals, verdicts) on hand-made per-prompt counts."""
import json
import sys
from pathlib import Path

import pytest

from benchmarks.moe import ArmResult, PhaseScore, arms, paired_scores, verdict
from tests.conftest import single_thread, tiny_overrides

_single_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def _arm(name, baseline, counts):
    tau = sum(c[0] for c in counts) / sum(c[1] for c in counts)
    s = PhaseScore(tau_sim=1.0, top1_sim=0.0, tau_real=tau, tau_real_ci95=None, ratio_to_baseline=None,
                   ratio_ci95=None, accept_rate_per_pos=None, greedy_mismatches=0, eval_dir=None)
    return ArmResult(name=name, label=name, baseline=baseline, params=1, trainable_params=1, selection={}, steps=1,
                     loss_tokens=1, train_loss_first=1.0, train_loss_last=1.0, seconds=0.0, after=s,
                     counts={"after": counts}, prompts={"after": [f"p{i}" for i in range(len(counts))]})


def test_paired_verdicts_follow_the_interval():
    # 12 prompts: "better" saves target forwards on every prompt, "same" is the baseline itself, "noisy" is better
    # on half the prompts and worse on the other half (its paired interval must straddle 1)
    base = [[32, 24 + (i % 5)] for i in range(12)]
    better = [[n, f - 6] for n, f in base]
    noisy = [[n, f - 6 if i % 2 else f + 6] for i, (n, f) in enumerate(base)]
    worse = [[n, f + 8] for n, f in base]
    res = {"hot": _arm("hot", "hot", base), "better": _arm("better", "hot", better),
           "same": _arm("same", "hot", [list(c) for c in base]), "noisy": _arm("noisy", "hot", noisy),
           "worse": _arm("worse", "hot", worse)}
    paired_scores(res, "after")
    got = {n: verdict(res, n) for n in res}
    assert got == {"hot": "-", "better": "better", "same": "tie", "noisy": "tie", "worse": "worse"}
    assert res["same"].after.ratio_ci95 == [1.0, 1.0] and res["better"].after.ratio_to_baseline > 1
    lo, hi = res["hot"].after.tau_real_ci95
    assert lo <= res["hot"].after.tau_real <= hi
    res["worse"].prompts["after"][0] = "another prompt"
    with pytest.raises(ValueError, match="different prompts"):
        paired_scores(res, "after")


def test_arm_table_pairs_each_arm_with_a_baseline_of_the_same_family():
    t = arms()
    assert set(t) == {"hot", "dense", "random", "cold", "eagle3", "eagle3_hot"}
    assert {n for n, a in t.items() if a.baseline == "hot"} == {"hot", "dense", "random", "cold"}
    assert all(t[a.baseline].recipe == a.recipe for a in t.values())


def test_bench_smoke_every_arm_on_a_tiny_mixtral(tiny_moe_dirs, tiny_data_file, tmp_path):
    from benchmarks.moe import main
    from specdistill.moe.build import select_experts
    from specdistill.moe.profiler import RoutingProfile

    out = tmp_path / "bench"
    over = [o for o in tiny_overrides(tiny_moe_dirs["mixtral"], tiny_data_file, tmp_path / "unused", tmp_path / "c")
            if not o.startswith("trainer.output_dir")]
    over += ["trainer.max_steps=2", "trainer.grad_accum=1", "draft.num_layers=2", "draft.moe.num_experts=2",
             "draft.moe.profile_batches=2", "draft.draft_vocab_size=64", f"eval.prompts={tiny_data_file}",
             "eval.max_new_tokens=6", "eval.gamma=3", "trainer.lr=3e-3"]
    r = main([f"--out={out}", "--spread-prompts=3", *over])
    for f in ("results.json", "results.md", "results.png", "profile.json", "heatmap.png", "prompts.jsonl"):
        assert (out / f).exists(), f
    a = r["arms"]
    prof = RoutingProfile.load(out / "profile.json")
    # selections pick what they say, from the shared profile, at one expert count
    assert a["hot"]["selection"]["experts"] == [sorted(prof.ranked(s)[:2]) for s in (0, 1)]
    assert a["cold"]["selection"]["experts"] == [sorted(prof.ranked(s)[-2:]) for s in (0, 1)]
    assert a["dense"]["selection"]["experts"] == a["hot"]["selection"]["experts"]
    rnd = select_experts(prof, [0, 1], count=2, selection="random", seed=0)
    assert a["random"]["selection"]["experts"] == [rnd[0], rnd[1]] and a["random"]["selection"]["selection_seed"] == 0
    assert a["eagle3_hot"]["selection"]["experts"] == [prof.ranked(2)[:1]]
    # equal parameters (dense: minus the router rows it drops; EAGLE-3 pair: the MLP of one expert = the plain MLP)
    assert a["hot"]["params"] == a["random"]["params"] == a["cold"]["params"]
    H = 32
    assert a["hot"]["params"] - a["dense"]["params"] == 2 * (2 - 1) * H
    assert a["eagle3"]["params"] == a["eagle3_hot"]["params"]
    # equal budget: same steps and the same loss tokens (same data order) within each family
    assert len({a[n]["loss_tokens"] for n in ("hot", "dense", "random", "cold")}) == 1
    assert len({a[n]["steps"] for n in a}) == 1
    for n, arm in a.items():
        for phase in ("before", "after"):
            s = arm[phase]
            assert s["greedy_mismatches"] == 0, (n, phase)
            assert s["tau_real"] >= 1 and s["tau_sim"] >= 1
            assert len(r["counts"][n][phase]) == 3  # the spread prompts, every arm and phase
    # one bootstrap implementation: scripts/compare_evals.py on the bench's folders gives the bench's interval
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import compare_evals

    hot_dir, cold_dir = a["hot"]["after"]["eval_dir"], a["cold"]["after"]["eval_dir"]
    table = compare_evals.main([cold_dir, hot_dir, "--baseline", hot_dir, "--out", str(tmp_path / "cmp")])
    assert table["overall"][cold_dir]["ratio_ci95"] == pytest.approx(a["cold"]["after"]["ratio_ci95"])
    assert json.loads((out / "results.json").read_text())["verdicts"]["hot"] == "-"


def test_spread_subset_takes_evenly_spaced_first_turns(tiny_data_file, tmp_path):
    from specdistill.data.prompts import load_prompt_messages
    from benchmarks.moe import spread_subset

    rows, _ = load_prompt_messages(str(tiny_data_file))
    got, _ = load_prompt_messages(str(spread_subset(str(tiny_data_file), 4, tmp_path / "p.jsonl")))
    n = len(rows)
    assert [m for _, m in got] == [rows[round(i * n / 4)][1] for i in range(4)]
    assert len({json.dumps(m) for _, m in got}) == 4
    with pytest.raises(ValueError, match="--spread-prompts=0"):
        spread_subset(str(tiny_data_file), 0, tmp_path / "q.jsonl")
