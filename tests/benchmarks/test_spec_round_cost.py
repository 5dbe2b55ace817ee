"""python -m benchmarks.spec_round_cost on a toy target: rounds timed per batch and cache mode, and --count-ops counts
the operators the host issues per round outside compiled graphs, which compiling the decode steps (the target's and
the EAGLE-3 head's forwards; compiled-target: the target's alone) cuts."""
import json

from benchmarks.spec_round_cost import main


def test_compiled_rounds_issue_fewer_host_operators(tmp_path):
    out = tmp_path / "rounds.json"
    res = main(["--device", "cpu", "--tiny", "--backend", "eager", "--layers", "2", "--batches", "2", "--modes",
                "growing", "compiled-target", "compiled", "--prompt", "8", "--new-tokens", "12", "--draft-vocab", "64",
                "--count-ops", "--out", str(out)])
    by_mode = {p["mode"]: p for p in res["points"]}
    assert set(by_mode) == {"growing", "compiled-target", "compiled"}
    for p in by_mode.values():
        assert p["rounds"] > 1 and p["round_ms"] > 0 and p["host_ops_per_round"] > 0
    # the target's forward and the head's draft steps run as graphs: far fewer operators issued one by one
    assert by_mode["compiled"]["host_ops_per_round"] < 0.6 * by_mode["compiled-target"]["host_ops_per_round"]
    assert by_mode["compiled-target"]["host_ops_per_round"] < by_mode["growing"]["host_ops_per_round"]
    assert json.loads(out.read_text())["points"] == res["points"]


def test_the_decoders_own_host_work_stays_within_its_budget():
    """--drafter none (target-only steps) and oracle (drafting free, every draft accepted): what the host issues per
    step and per round outside the compiled graphs, of which the computing operators each launch a kernel on a GPU.
    The budgets sit a little above what this toy issues (22 computing operators a step, 92 a round): a change that
    puts kernels back into every step fails here."""
    res = main(["--device", "cpu", "--tiny", "--backend", "eager", "--layers", "2", "--batches", "2", "--modes",
                "compiled", "--prompt", "8", "--new-tokens", "24", "--count-ops", "--drafter", "none"])
    (step,) = res["points"]
    assert step["rounds"] == 24 and step["tau"] == 1.0
    assert 0 < step["host_kernels_per_round"] < step["host_ops_per_round"]
    assert step["host_kernels_per_round"] <= 28
    res = main(["--device", "cpu", "--tiny", "--backend", "eager", "--layers", "2", "--batches", "2", "--modes",
                "compiled", "--prompt", "8", "--new-tokens", "24", "--count-ops", "--drafter", "oracle"])
    (rnd,) = res["points"]
    assert rnd["tau"] > 4 and rnd["rounds"] <= 6  # gamma 4: five tokens a round
    assert rnd["host_kernels_per_round"] <= 110


def test_views_and_no_op_casts_are_not_counted_as_kernels():
    import torch

    from benchmarks.decode_bandwidth import host_ops

    x = torch.ones(4, 3)
    ops, out = host_ops(lambda: (x[1:].unsqueeze(0).to(torch.float32), x + 1))
    assert ops.kernels == 1 and ops.ops >= 4
    assert torch.equal(out[1], x + 1)
