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
