"""benchmarks.rollout_rows on tiny models: both settings decode the same prompts, the rollout that drops stopped
rows feeds its verify forwards only the active rows, the other every row, and the files say how they were made."""
import json

import pytest

from benchmarks.rollout_rows import main
from tests.conftest import tiny_overrides


@pytest.mark.filterwarnings("ignore")
def test_rollout_rows_times_both_settings_and_counts_the_rows_fed(tiny_target_dir, tiny_data_file, tmp_path):
    import specdistill.onpolicy.rollout as rollout

    before = rollout.speculative_generate
    overrides = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "run", tmp_path / "cache")
    res = main(["--repeats", "1", "--out", str(tmp_path / "rows"), "draft=eagle3", "objective.max_new_tokens=12",
                "objective.temperature=0", "trainer.grad_accum=1"] + overrides)
    drop, keep = res["runs"]
    assert (drop["drop"], keep["drop"]) == (True, False)
    assert drop["seconds"] > 0 and keep["seconds"] > 0
    # greedy: the same outputs either way; only the rows fed differ
    assert drop["per_row"] == keep["per_row"] and drop["tokens"] == keep["tokens"]
    assert drop["active_row_rounds"] == keep["active_row_rounds"] == drop["fed_row_rounds"]
    # every row each round without drops (with these random tiny models the rows end together, so the two may be
    # equal; that drops feed fewer rows where rows end apart is tests/decoding/test_drop_finished.py's)
    assert keep["fed_row_rounds"] == keep["rounds"] * len(keep["per_row"]) >= drop["fed_row_rounds"]
    assert rollout.speculative_generate is before  # the swap is undone
    saved = json.loads((tmp_path / "rows" / "results.json").read_text())
    assert saved["command"].startswith("python -m benchmarks.rollout_rows --repeats 1")
    assert "| True |" in (tmp_path / "rows" / "results.md").read_text()
