"""benchmarks.position_curves: evaluations' acceptance-by-output-position rows -> one table, plot and JSON."""
import argparse
import json

import pytest

from benchmarks import position_curves as pc


def _results(path, taus, temperature=0.0):
    rows = [{"start": s, "end": e, "label": f"{s}-{e - 1}" if e else f"{s}+", "prompts": 3, "rounds": 10, "tau": t,
             "tau_ci95": [t - 0.1, t + 0.1]} for (s, e), t in zip([(0, 128), (128, 256), (256, None)], taus)]
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps(
        {"temperature": temperature, "mean_accept_len": sum(taus) / len(taus), "num_prompts": 3,
         "max_new_tokens": 512, "accept_by_output_position": rows}))
    return path


def test_every_run_and_bucket_lands_in_the_table_plot_and_json(tmp_path):
    a = _results(tmp_path / "a", [1.5, 1.4, 1.3])
    b = _results(tmp_path / "b", [1.2, 1.25], temperature=1.0)  # b never reached the last bucket
    curves = pc.main([f"A=T=0={a}", f"B={b}/results.json", "--out", str(tmp_path / "out" / "curve")])
    assert list(curves) == ["A=T=0", "B"]  # a label may itself hold '='
    md = (tmp_path / "out" / "curve.md").read_text()
    assert "| A=T=0 | 1.400 | 1.500 [1.400, 1.600] (3) | 1.400" in md
    assert md.splitlines()[-1].endswith("| - |")  # B's missing bucket
    saved = json.loads((tmp_path / "out" / "curve.json").read_text())
    assert saved["command"].startswith("python -m benchmarks.position_curves")
    assert saved["curves"]["B"]["temperature"] == 1.0
    assert (tmp_path / "out" / "curve.png").stat().st_size > 0


def test_bad_runs_are_refused_naming_the_fix(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL=path"):
        pc.parse_run("no-label-here")
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        pc.parse_run(f"x={tmp_path / 'missing'}")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text(json.dumps({"mean_accept_len": 1.0}))
    with pytest.raises(ValueError, match="no accept_by_output_position"):
        pc.load_curve(tmp_path / "old" / "results.json")


def _bench(path, buckets_per_prompt):
    """A benchmarks.recipes results.json with one variant scored at T=1, per-prompt output buckets as given."""
    samples = []
    for i, cells in enumerate(buckets_per_prompt):
        tokens = sum(c["tokens"] for c in cells.values())
        rounds = sum(c["rounds"] for c in cells.values())
        samples.append({"prompt": i, "new_tokens": tokens, "target_forwards": rounds, "output_buckets": cells})
    settings = {"prompts": "embedded:mt_bench", "num_prompts": len(samples), "max_new_tokens": 512,
                "temperature": 1.0, "gamma": 4, "draft_policy": "greedy"}
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"variants": {"arm": {"points": [
        {"fraction": 1.0, "steps": 5, "eval": {"T=1": {"eval_settings": settings, "samples": samples}}}]}}}))
    return path


def test_a_bench_variant_curve_comes_from_its_per_prompt_buckets(tmp_path):
    cell = lambda rounds, tokens: {"rounds": rounds, "tokens": tokens, "proposed": 4 * rounds,  # noqa: E731
                                   "accepted": tokens - rounds}
    # prompt 0 reaches both buckets (tau 2.0 then 1.0), prompt 1 only the first (tau 1.5)
    bench = _bench(tmp_path / "bench", [{"0_127": cell(10, 20), "128_255": cell(8, 8)}, {"0_127": cell(10, 15)}])
    curves = pc.main([f"arm={bench}#arm", "--temperature", "1", "--out", str(tmp_path / "c")])
    c = curves["arm"]
    assert c["temperature"] == 1.0 and c["num_prompts"] == 2
    assert c["tau"] == pytest.approx(43 / 28)
    first, second = c["buckets"]
    assert (first["label"], first["prompts"], first["tau"]) == ("0-127", 2, pytest.approx(35 / 20))
    assert (second["label"], second["prompts"], second["tau"]) == ("128-255", 1, pytest.approx(1.0))
    assert first["tau_ci95"][0] <= first["tau"] <= first["tau_ci95"][1]
    with pytest.raises(ValueError, match="not T=0"):
        pc.main([f"arm={bench}#arm", "--out", str(tmp_path / "d")])  # scored at T=1 only
    with pytest.raises(argparse.ArgumentTypeError, match="benchmarks.recipes output folder"):
        pc.parse_run(f"x={tmp_path / 'nowhere'}#arm")


def test_the_last_bucket_over_the_first_pairs_the_same_prompts(tmp_path):
    """Two prompts halve their tau from the first bucket to the last; a third, short prompt with a low tau in the
    first bucket only would make a pooled curve fall less: the paired ratio is exactly 0.5, interval included."""
    run = _results(tmp_path / "run", [1.5, 1.4, 1.3])
    cell = lambda rounds, tokens: {"rounds": rounds, "tokens": tokens, "proposed": 4 * rounds,  # noqa: E731
                                   "accepted": tokens - rounds}
    samples = [{"prompt": 0, "output_buckets": {"0_127": cell(10, 20), "128_255": cell(9, 10), "256_plus": cell(8, 8)}},
               {"prompt": 1, "output_buckets": {"0_127": cell(20, 40), "256_plus": cell(16, 16)}},
               {"prompt": 2, "output_buckets": {"0_127": cell(50, 50)}}]
    (run / "outputs.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    d = pc.main([f"run={run}", "--out", str(tmp_path / "c")])["run"]["last_over_first"]
    assert (d["first"], d["last"], d["prompts"]) == ("0-127", "256+", 2)
    assert d["tau_ratio"] == pytest.approx(0.5) and d["tau_ratio_ci95"] == pytest.approx([0.5, 0.5])
    assert "0.500x [0.500, 0.500] (256+ / 0-127, 2)" in (tmp_path / "c.md").read_text()
    # without per-prompt samples, or with no later bucket two prompts reached: no ratio, a '-' in the table
    (run / "outputs.jsonl").write_text(json.dumps(samples[0]) + "\n")
    assert pc.main([f"run={run}", "--out", str(tmp_path / "d")])["run"]["last_over_first"] is None
    assert (tmp_path / "d.md").read_text().splitlines()[-1].endswith("| - |")
