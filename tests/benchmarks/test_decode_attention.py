"""python -m benchmarks.decode_attention at a toy shape: every masked implementation computes the attention the
compiled decode steps run (sdpa_grouped with the column mask), for a decode step and a verify step, and each is timed
against the bytes it reads."""
import json

import pytest

from benchmarks.decode_attention import VARIANTS, main


@pytest.mark.parametrize("queries", [1, 3])
def test_every_masked_attention_agrees_and_is_timed(tmp_path, queries):
    out = tmp_path / "attention.json"
    res = main(["--device", "cpu", "--batch", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                "--columns", "64", "--used", "40", "--queries", str(queries), "--iters", "2", "--out", str(out)])
    by_name = {t["variant"]: t for t in res["timings"]}
    assert set(by_name) == set(VARIANTS)
    for name in ("grouped", "repeat", "gqa", "flex"):
        assert by_name[name]["max_abs_diff"] < 1e-4, name
    assert by_name["unmasked"]["max_abs_diff"] > 1e-3  # it attends the holes: a bound on time, not the same output
    assert by_name["unmasked"]["bytes_read"] < by_name["grouped"]["bytes_read"] == 2 * 2 * 2 * 64 * 16 * 4
    assert all(t["us_per_call"] > 0 and t["fraction"] > 0 for t in res["timings"])
    assert json.loads(out.read_text())["timings"] == res["timings"]
