"""benchmarks.draft_rounds on a tiny head: every round lands in a bucket of output position, and its files say how
they were made."""
import json

from benchmarks.draft_rounds import main


def test_draft_rounds_reports_each_bucket_it_reached_and_saves_its_command(tmp_path):
    out = tmp_path / "rounds"
    r = main(["--tiny", "--new-tokens", "140", "--prompt", "8", "--accept", "0.5", "--out", str(out)])
    by_position = r["round_ms_by_position"]
    assert list(by_position) == ["0-127", "128-255", "256-511", "512+"]
    assert by_position["0-127"] > 0 and by_position["128-255"] > 0      # the output reached 128 tokens
    assert by_position["256-511"] is None and by_position["512+"] is None
    # at most gamma + 1 tokens a round: 140 tokens cannot take fewer than 28 rounds, nor more than 140
    assert 28 <= r["rounds"] <= 140
    saved = json.loads((out / "results.json").read_text())
    assert saved["command"].startswith("python -m benchmarks.draft_rounds --tiny")
    assert "| 128-255 |" in (out / "results.md").read_text()
