"""Bootstrap intervals of tau over prompts, and scripts/compare_evals.py's paired comparison of evaluator runs."""
import json

import pytest
import torch

from specdistill.eval.stats import ratio_interval, tau_interval


def _counts(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    forwards = torch.randint(20, 60, (n,), generator=g)
    tokens = forwards + torch.randint(0, 30, (n,), generator=g)
    return torch.stack([tokens, forwards], 1).tolist()


def test_tau_interval_brackets_the_estimate_and_narrows_with_more_prompts():
    c = _counts(24)
    tau = sum(x[0] for x in c) / sum(x[1] for x in c)
    lo, hi = tau_interval(c)
    assert lo < tau < hi
    wide = tau_interval(c[:6])
    assert wide[1] - wide[0] > hi - lo
    assert tau_interval(c[:1]) is None and tau_interval([]) is None


def test_paired_ratio_removes_the_spread_both_runs_share():
    a = _counts(24)
    assert ratio_interval(a, a) == [1.0, 1.0]
    b = [[round(t * 1.25), f] for t, f in a]          # every prompt 25% more tokens per forward
    lo, hi = ratio_interval(b, a)
    assert 1.24 < lo <= hi < 1.26                     # prompt difficulty cancels: an interval of rounding only
    assert ratio_interval(a, a[:-1]) is None          # not the same prompts: no paired interval


def _eval_dir(path, tau_scale, prompts=(0, 1, 2, 3), temperature=0.0, draft_policy="greedy"):
    path.mkdir()
    rows = [{"prompt": p, "category": "math" if p % 2 else "writing", "new_tokens": round(30 * tau_scale) + p,
             "target_forwards": 30, "reached_per_pos": [30, 20], "accepted_per_pos": [20, 10]} for p in prompts]
    (path / "outputs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tau = sum(r["new_tokens"] for r in rows) / sum(r["target_forwards"] for r in rows)
    (path / "results.json").write_text(json.dumps({"mean_accept_len": tau, "draft_policy": draft_policy, "config": {
        "temperature": temperature, "gamma": 4, "draft_path": str(path)}}))
    return str(path)


def test_compare_evals_writes_paired_ratios_overall_and_per_category(tmp_path):
    from specdistill.cli.compare_evals import main

    base, better = _eval_dir(tmp_path / "kd", 1.2), _eval_dir(tmp_path / "opd", 1.5)
    res = main([base, better, "--out", str(tmp_path / "cmp")])
    table = res["overall"]
    assert table[better]["ratio_to_baseline"] == pytest.approx(table[better]["tau"] / table[base]["tau"])
    assert table[base]["ratio_ci95"] == [1.0, 1.0] and table[better]["ratio_ci95"][0] > 1.0
    assert table[better]["accept_rate_per_pos"] == [pytest.approx(2 / 3), 0.5]
    # per category: each category's tau is its own prompts' ratio of sums (math: prompts 1 and 3)
    math = res["by_category"]["math"][better]
    assert math["prompts"] == 2 and math["tau"] == pytest.approx((45 + 1 + 45 + 3) / 60)
    assert set(res["by_category"]) == {"math", "writing"}
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| math | 2 |" in md and md.count("|") > 8
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["meta"]["baseline"] == base


@pytest.mark.parametrize("name, kw, says", [("other", {"prompts": (0, 1, 2, 5)}, "prompt indices"),
                                            ("hot", {"temperature": 1.0}, "temperature"),
                                            ("sampled", {"draft_policy": "sample"}, "draft_policy")])
def test_compare_evals_refuses_runs_made_under_other_settings_unless_allowed(tmp_path, name, kw, says):
    from specdistill.cli.compare_evals import main

    base, other = _eval_dir(tmp_path / "kd", 1.2), _eval_dir(tmp_path / name, 1.3, **kw)
    with pytest.raises(ValueError, match=f"{says}.*--allow-mismatch"):
        main([base, other, "--out", str(tmp_path / "cmp")])
    res = main([base, other, "--out", str(tmp_path / "cmp"), "--allow-mismatch"])
    assert res["differences"][other] and "Settings differ" in (tmp_path / "cmp" / "compare.md").read_text()
    assert res["overall"][other]["prompts"] == (3 if name == "other" else 4)  # paired on the prompts both ran


def _bench_dir(path, variants):
    """A specdistill-bench output folder: results.json with each variant's scorings (per-prompt samples)."""
    def scoring(scale, T):
        rows = [{"prompt": p, "category": "math" if p % 2 else "writing", "new_tokens": round(30 * scale) + p,
                 "target_forwards": 30, "reached_per_pos": [30, 20], "accepted_per_pos": [20, 10]} for p in range(6)]
        settings = {"prompts": "embedded:mt_bench", "num_prompts": 6, "max_new_tokens": 64, "temperature": T,
                    "gamma": 4, "draft_policy": "greedy"}
        return {"mean_accept_len": sum(r["new_tokens"] for r in rows) / 180, "samples": rows,
                "eval_settings": settings}
    path.mkdir()
    out = {}
    for name, scales in variants.items():
        points = [{"fraction": f, "steps": 10 * (k + 1), "eval": {"T=0": scoring(s, 0.0), "T=1": scoring(s - 0.1, 1.0)}}
                  for k, (f, s) in enumerate(scales)]
        out[name] = {"points": points, "eval": points[-1]["eval"]}
    (path / "results.json").write_text(json.dumps({"variants": out}))
    return str(path)


def test_compare_evals_pairs_scorings_of_different_bench_runs_by_variant_and_budget_point(tmp_path):
    from specdistill.cli.compare_evals import main

    a = _bench_dir(tmp_path / "wall", {"eagle3_regen": [(0.5, 1.2), (1.0, 1.3)]})
    b = _bench_dir(tmp_path / "abl", {"no_replay": [(1.0, 1.5)]})
    res = main([f"{a}#eagle3_regen@0.5", f"{b}#no_replay", "--out", str(tmp_path / "cmp")])
    t = res["overall"]
    base, other = t[f"{a}#eagle3_regen@0.5"], t[f"{b}#no_replay"]
    assert base["tau"] == pytest.approx((36 * 6 + 15) / 180) and other["tau"] == pytest.approx((45 * 6 + 15) / 180)
    assert other["ratio_ci95"][0] > 1.0
    last = main([f"{a}#eagle3_regen", f"{a}#eagle3_regen@0.5", "--temperature", "1", "--out", str(tmp_path / "c2")])
    assert last["overall"][f"{a}#eagle3_regen"]["tau"] == pytest.approx((round(30 * 1.2) * 6 + 15) / 180)  # T=1, 1.0


@pytest.mark.parametrize("spec, says", [("{a}#kd", "holds no variant 'kd'"), ("{a}#eagle3_regen@0.7", "not 0.7"),
                                        ("{a}#eagle3_regen@half", "not a number"),
                                        ("{m}#eagle3_regen", "results.json is missing")])
def test_compare_evals_names_what_is_wrong_with_a_bench_spec(tmp_path, spec, says):
    from specdistill.cli.compare_evals import main

    a = _bench_dir(tmp_path / "wall", {"eagle3_regen": [(0.5, 1.2), (1.0, 1.3)]})
    with pytest.raises((ValueError, FileNotFoundError), match=says):
        main([f"{a}#eagle3_regen", spec.format(a=a, m=tmp_path / "nothing"), "--out", str(tmp_path / "cmp")])
    with pytest.raises(ValueError, match="not T=0.5: pass --temperature"):
        main([f"{a}#eagle3_regen", "--temperature", "0.5", "--out", str(tmp_path / "cmp")])
