"""The recipe benchmark's variant table: each variant's draft kind comes from its composed config, and a trained
variant is re-evaluated from its saved draft through that kind's adapter (no model is loaded here)."""
import json
from argparse import Namespace

import pytest

from benchmarks import recipes as bench


def _args(tmp_path):
    return Namespace(target="some/target", data="data.jsonl", max_rows=8, max_length=64, seed=0, micro_batch_size=1,
                     grad_accum=1, out=str(tmp_path), lr=None, override=[])


@pytest.mark.parametrize("name, recipe, init", [("kd", "kd", "pretrained"), ("draft_opd", "kd", "pretrained"),
                                                ("eagle3", "eagle3", "eagle3"),
                                                ("draft_opd_eagle3", "eagle3", "eagle3")])
def test_a_variant_is_reevaluated_from_its_saved_draft_by_its_kind(name, recipe, init, tmp_path):
    got, overrides = bench.reeval_recipe(_args(tmp_path), name, {"checkpoint": str(tmp_path / "ck")})
    assert got == recipe
    cfg = bench.compose(got, overrides)
    assert cfg.draft.init == init and cfg.draft.path == str(tmp_path / "ck" / "draft")


# ------------------------------------------------------------------------------------------------ the head benchmark
def test_checkpoint_steps_are_the_budget_fractions_of_one_run():
    assert bench.checkpoint_steps([0.5, 1.0], 40) == [20, 40]
    assert bench.checkpoint_steps([0.25, 0.5, 1.0], 3) == [1, 2, 3]  # at least one step, the last one last
    assert bench.checkpoint_steps([0.1, 0.2, 1.0], 4) == [1, 1, 4]  # one per fraction: the points stay aligned
    assert bench.checkpoint_steps([0.3, 1.0], 75, quantum=4) == [24, 75]  # multiples of the quantum, but the end


@pytest.mark.parametrize("argv, says", [(["--budget", "wall_time"], "needs --minutes"),
                                        (["--minutes", "3"], "needs --minutes"),
                                        (["--checkpoints-at", "0.5"], "ending at 1.0"),
                                        (["--checkpoints-at", "1.0", "0.5"], "increasing")])
def test_bad_budget_arguments_are_refused_early(argv, says, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert says in capsys.readouterr().err


@pytest.fixture(scope="module")
def head_bench(tiny_target_dir, tiny_data_file, tmp_path_factory):
    """A tiny EAGLE-3 head (recipe eagle3, 2 steps: the stand-in for the main recipe's strong head), the knobs every
    head-benchmark run shares, and a prompt file with two MT-bench-style categories."""
    from specdistill.pipeline.run import build_components
    from specdistill.train.loop import fit
    from tests.conftest import compose, single_thread, tiny_overrides

    gen = single_thread()
    next(gen)
    root = tmp_path_factory.mktemp("head_bench")
    cache = root / "cache"
    cfg = compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, root / "head", cache) +
                  ["trainer.max_steps=2", "trainer.measure_roofline=false", "objective.steps=2"])
    head = fit(build_components(cfg)).final_checkpoint / "draft"
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t], "category": c}) for t, c in [
        ("tell me about the cat", "writing"), ("what is one two three", "math"), ("why is the bird red", "writing"),
        ("how many dogs ran to the park", "math")]))
    overrides = [o for o in tiny_overrides(tiny_target_dir, tiny_data_file, root / "unused", cache)
                 if o.split("=")[0] in ("target.dtype", "data.format", "data.heldout_size", "data.cache_dir")
                 or o.startswith("data.regenerate.")]
    knobs = ["--target", str(tiny_target_dir), "--data", str(tiny_data_file), "--max-rows", "48", "--max-length",
             "64", "--micro-batch-size", "2", "--rollout-tokens", "6", "--prompts", str(prompts), "--num-prompts",
             "4", "--max-new-tokens", "8", "--gamma", "2", "--no-cost", "--threads", "1",
             "--override", f"draft.path={head}", "trainer.measure_roofline=false", *overrides]
    yield knobs, root
    next(gen, None)


def test_head_arms_at_equal_target_tokens_scored_at_two_budget_points(head_bench):
    knobs, root = head_bench
    out = root / "tokens"
    argv = ["--variants", "eagle3_regen", "draft_opd_eagle3", "--budget", "target_tokens", "--steps", "2",
            "--checkpoints-at", "0.5", "1.0", "--temperatures", "0", "1", "--out", str(out)] + knobs
    res = bench.run_bench(argv)
    opd, off = res["draft_opd_eagle3"], res["eagle3_regen"]
    # one run per arm, scored at its checkpoints; the on-policy reference's target tokens are the off-policy budget
    assert [p["steps"] for p in opd["points"]] == [1, 2]
    assert [p["fraction"] for p in off["points"]] == [0.5, 1.0]  # the reference's fractions of the token budget
    assert opd["points"][0]["target_forward_tokens"] < opd["points"][1]["target_forward_tokens"]
    for p_off, p_opd in zip(off["points"], opd["points"]):
        assert p_off["target_forward_tokens"] >= p_opd["target_forward_tokens"]  # the first step that reaches it
    kept = sorted(p.name for p in (out / "runs" / "draft_opd_eagle3" / "checkpoints").iterdir())
    assert kept == ["step-0000001", "step-0000002"]
    e = opd["points"][0]["eval"]["T=1"]
    assert e["eval_settings"]["draft_policy"] == "greedy" and set(e["by_category"]) == {"writing", "math"}
    data = json.loads((out / "results.json").read_text())
    assert len(data["comparisons"]) == 4  # 2 budget points x 2 temperatures
    cmp = data["comparisons"][-1]
    assert cmp["baseline"] == "eagle3_regen" and cmp["overall"]["eagle3_regen"]["ratio_ci95"] == [1.0, 1.0]
    ratio = cmp["overall"]["draft_opd_eagle3"]["ratio_to_baseline"]
    assert ratio == pytest.approx(opd["eval"]["T=1"]["mean_accept_len"] / off["eval"]["T=1"]["mean_accept_len"])
    md = (out / "results.md").read_text()
    assert "Command: `python -m benchmarks.recipes --variants eagle3_regen" in md and "| math | 2 |" in md
    assert (out / "tau_vs_budget.png").stat().st_size > 1000


def test_wall_time_budget_stops_each_arm_at_its_minutes_and_resumes(head_bench):
    knobs, root = head_bench
    out = root / "wall"
    res = bench.run_bench(["--variants", "draft_opd_eagle3", "--budget", "wall_time", "--minutes", "0.03",
                           "--steps", "1000", "--checkpoints-at", "0.5", "1.0", "--temperatures", "0",
                           "--out", str(out)] + knobs)
    pts = res["draft_opd_eagle3"]["points"]
    assert len(pts) == 2 and 0 < pts[0]["steps"] < pts[1]["steps"] < 1000  # the clock, not the step cap, stopped it
    assert 0.5 * 0.03 * 60 <= pts[0]["train_seconds"] < pts[1]["train_seconds"]
    assert pts[1]["train_seconds"] >= 0.03 * 60 and not res["draft_opd_eagle3"]["step_cap_reached"]


def test_a_signal_that_stops_a_variants_training_stops_the_benchmark(head_bench, monkeypatch):
    """SIGTERM makes the loop checkpoint and return early; the bench must not score (or resume) that run as if its
    budget were spent, nor go on to the next variant beside whatever sent the signal."""
    import specdistill.train.loop as loop

    knobs, root = head_bench
    real = loop.fit

    def stopped(c):
        res = real(c)
        res.preempted = "SIGTERM"
        return res

    monkeypatch.setattr(loop, "fit", stopped)
    out = root / "stopped"
    argv = ["--variants", "eagle3_regen", "draft_opd_eagle3", "--steps", "1", "--temperatures", "0",
            "--out", str(out)] + knobs
    with pytest.raises(bench.BenchStopped, match="eagle3_regen: its training was stopped by SIGTERM"):
        bench.run_bench(argv)
    assert not (out / "runs" / "draft_opd_eagle3").exists()  # the next variant never started
    with pytest.raises(SystemExit, match="--append --overwrite"):
        bench.main(argv + ["--overwrite"])


def test_target_token_budget_orders_the_reference_first_and_names_it():
    """--budget target_tokens: the first on-policy variant trains first and its target tokens are the others'
    budget; a benchmark without one is refused before anything trains."""
    args = bench.parse_args(["--variants", "kd", "draft_opd_no_replay", "draft_opd", "--budget", "target_tokens"])
    b = bench.BenchState(args, bench.size_knobs(args))
    bench._choose_reference(b)
    assert b.reference == "draft_opd_no_replay" and b.budget_tokens is None
    assert bench._training_order(b, ["kd", "draft_opd_no_replay", "draft_opd"]) == ["draft_opd_no_replay", "kd",
                                                                                  "draft_opd"]
    b.budget_tokens = 1234
    assert "1234 tokens through the target (draft_opd_no_replay's 40 steps)" in bench._budget(b)["description"]
    only_kd = bench.parse_args(["--variants", "kd", "--budget", "target_tokens"])
    b = bench.BenchState(only_kd, bench.size_knobs(only_kd))
    bench._choose_reference(b)
    with pytest.raises(ValueError, match="include one"):
        bench._training_order(b, ["kd"])


def test_fresh_arm_needs_its_answer_length(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "eagle3_fresh"])
    assert "--fresh-tokens N" in capsys.readouterr().err


def test_fresh_arm_regenerates_its_own_answers_and_rollouts_take_their_temperature(head_bench):
    """eagle3_fresh trains on answers regenerated at --fresh-tokens and --fresh-temperature (its own store, a training
    length that holds them); the on-policy arm rolls out at --rollout-temperature; scorings keep acceptance by output
    position for scripts/compare_evals.py."""
    from omegaconf import OmegaConf

    knobs, root = head_bench
    out = root / "fresh"
    res = bench.run_bench(["--variants", "eagle3_fresh", "draft_opd_eagle3", "--steps", "1", "--temperatures", "1",
                           "--fresh-tokens", "12", "--fresh-prompts", "6", "--rollout-temperature", "0.5",
                           "--out", str(out)] + knobs)
    fresh = OmegaConf.load(out / "runs" / "eagle3_fresh" / "config.yaml")
    regen = fresh.data.regenerate
    assert (regen.max_new_tokens, regen.temperature, regen.max_prompts) == (12, 1.0, 6)
    assert fresh.data.max_length == max(64, regen.max_prompt_tokens + 12)
    assert OmegaConf.load(out / "runs" / "draft_opd_eagle3" / "config.yaml").objective.temperature == 0.5
    sample = res["eagle3_fresh"]["eval"]["T=1"]["samples"][0]
    assert "0_127" in sample["output_buckets"]
