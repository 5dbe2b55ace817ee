"""Recorded losses: every recipe's logged training losses over a few steps at tiny scale (fixed seeds), against values
recorded from a known-good run. They catch numeric drift that the invariant tests miss: a changed default, a loss
scaled or normalised differently, a reordered data stream.

The runs are the recipe tests' own (tests/test_train.py: test_every_recipe_trains_and_writes_a_checkpoint; tests/moe/
test_moe_objective.py: the moe_kd and moe_opd recipe tests), which call `check_recorded`; the values live in
tests/recorded_losses.json.

To re-record on purpose, after a change that is meant to move the numbers, run those tests with
SPECDISTILL_RECORD_LOSSES=1:

    SPECDISTILL_RECORD_LOSSES=1 pytest tests/test_train.py -k every_recipe tests/moe/test_moe_objective.py -k recipe

Each run then writes its losses into tests/recorded_losses.json instead of comparing; review the diff and commit it
with the change that explains it.
"""
import json
import os
from pathlib import Path

import pytest

RECORDED = Path(__file__).with_name("recorded_losses.json")
RECORD_ENV = "SPECDISTILL_RECORD_LOSSES"
# Relative tolerance: well above run-to-run rounding (reductions over a different thread count, attention kernels),
# well below what a changed loss, default or data order does to the first steps.
RTOL = 1e-4
ATOL = 1e-6  # for losses near zero (a draft that starts as the target: KD, the MoE drafts), where rounding is absolute


def check_recorded(name: str, losses: list[float], path: Path = RECORDED) -> None:
    """Assert a run's logged losses equal the ones recorded under `name` (within RTOL, or ATOL near zero); with
    SPECDISTILL_RECORD_LOSSES set, record them instead."""
    recorded = json.loads(path.read_text()) if path.exists() else {}
    if os.environ.get(RECORD_ENV):
        recorded[name] = [float(x) for x in losses]
        path.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")
        return
    assert name in recorded, (f"no losses recorded for {name!r} in {path.name}: record them with {RECORD_ENV}=1 "
                              "(see tests/test_recorded_losses.py)")
    want = recorded[name]
    assert len(losses) == len(want) and losses == pytest.approx(want, rel=RTOL, abs=ATOL), (
        f"{name}: logged losses {losses} differ from the recorded {want} (rtol {RTOL}). If the change is meant to "
        f"move them, re-record with {RECORD_ENV}=1 (see tests/test_recorded_losses.py)")


def test_every_recipe_has_recorded_losses():
    """A new recipe gets a recorded-loss entry (its recipe test records it)."""
    from specdistill.config import RECIPES_DIR

    recorded = json.loads(RECORDED.read_text())
    names = {k.split("[")[0] for k in recorded}
    assert names >= {p.stem for p in RECIPES_DIR.glob("*.yaml")}, sorted(names)
    assert all(len(v) >= 2 and all(x == x for x in v) for v in recorded.values())  # a few finite-looking steps


def test_a_drifted_loss_fails_and_an_equal_one_passes(tmp_path, monkeypatch):
    monkeypatch.delenv(RECORD_ENV, raising=False)
    path = tmp_path / "recorded.json"
    path.write_text(json.dumps({"kd": [2.0, 1.5, 1.25]}))
    check_recorded("kd", [2.0, 1.5 * (1 + RTOL / 10), 1.25], path)
    with pytest.raises(AssertionError, match="re-record"):
        check_recorded("kd", [2.0, 1.5 * (1 + RTOL * 10), 1.25], path)
    with pytest.raises(AssertionError):
        check_recorded("kd", [2.0, 1.5], path)  # a step missing
    with pytest.raises(AssertionError, match="no losses recorded"):
        check_recorded("sft", [1.0], path)
    monkeypatch.setenv(RECORD_ENV, "1")
    check_recorded("sft", [1.0, 0.5], path)
    assert json.loads(path.read_text()) == {"kd": [2.0, 1.5, 1.25], "sft": [1.0, 0.5]}
