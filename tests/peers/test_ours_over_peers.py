"""results.md's "Ours over each peer arm" section: computed from the paired table and the arms' throughput, with no
verdict against a threshold."""
from __future__ import annotations

import pytest

from benchmarks.peers.run import ours_over_peers, ours_over_peers_lines


def results(ratios: dict, wall_seconds=None, tps=None) -> dict:
    overall = {"specdistill": {"ratio_to_baseline": 1.0, "ratio_ci95": [1.0, 1.0]}}
    overall.update({n: {"ratio_to_baseline": r, "ratio_ci95": ci} for n, (r, ci) in ratios.items()})
    arms = {"specdistill": {"loss_tokens_per_s": (tps or {}).get("specdistill")}}
    arms.update({n: {"loss_tokens_per_s": (tps or {}).get(n)} for n in ratios})
    return {"settings": ["T0-g4"], "budget": "1 epoch(s) per arm", "wall_seconds": wall_seconds, "arms": arms,
            "paired": {"T0-g4": {"overall": overall}}}


def test_ours_over_a_peer_inverts_the_ratio_and_swaps_the_bounds():
    [o] = ours_over_peers(results({"specforge-defaults": (0.8, [0.75, 0.85])}), "T0-g4")
    assert o.ratio == pytest.approx(1.25) and o.lo == pytest.approx(1 / 0.85) and o.hi == pytest.approx(1 / 0.75)


def test_one_row_per_peer_arm_with_its_inverted_interval_and_no_verdict():
    md = "\n".join(ours_over_peers_lines(results({"a-defaults": (0.9, [0.85, 0.95]), "b-ours": (1.0, [0.97, 1.03])})))
    assert "equal loss tokens, 1 epoch(s) per arm" in md
    assert "| a-defaults | 1.111x [1.053, 1.176] | - |" in md and "| b-ours | 1.000x [0.971, 1.031] | - |" in md
    assert "yes" not in md and "| no |" not in md and "goal" not in md


def test_equal_wall_budget_and_throughput_ratio_per_arm():
    r = results({"a-defaults": (0.7, [0.65, 0.75]), "b-ours": (0.9, [0.85, 0.95])}, wall_seconds=600,
                tps={"specdistill": 300.0, "a-defaults": 100.0, "b-ours": 250.0})
    md = "\n".join(ours_over_peers_lines(r))
    assert "equal wall time, 600 s of training each" in md
    assert "| b-ours | 1.111x [1.053, 1.176] | 300.0 / 250.0 = 1.20x |" in md
    assert "| a-defaults | 1.429x [1.333, 1.538] | 300.0 / 100.0 = 3.00x |" in md


def test_no_paired_arm_says_so():
    md = "\n".join(ours_over_peers_lines(results({})))
    assert "no peer arm was scored and paired" in md
