"""Learning curves: every kept checkpoint is scored with real speculative decoding and the files are written."""
import json

from specdistill.build import build
from specdistill.pipeline.curve import learning_curve, write_curve
from specdistill.train.loop import fit
from tests.conftest import compose, tiny_overrides


def test_curve_scores_every_checkpoint_with_real_decoding(tiny_target_dir, tiny_data_file, tmp_path):
    out = tmp_path / "run"
    cfg = compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache")
                  + ["trainer.max_steps=4", "trainer.save_every=2", "trainer.keep_checkpoints=5"])
    c = build(cfg)
    fit(c)
    target, tok = c.models.target.model, c.models.tokenizer
    prompts = [tok("the cat sat")["input_ids"], tok("hello what is")["input_ids"]]
    pts = learning_curve(out, target, tok, prompts, gamma=3, max_new_tokens=6, progress=False, log=lambda *_: None)
    assert [p.step for p in pts] == [2, 4]
    assert pts[0].tokens_seen < pts[1].tokens_seen and pts[0].wall_minutes <= pts[1].wall_minutes
    for p in pts:
        assert 1.0 <= p.tau <= 4.0 and len(p.accept_rate_per_pos) == 3 and p.new_tokens > 0
    d = write_curve(pts, tmp_path / "curve", "test command", label="tiny")
    data = json.loads((d / "curve.json").read_text())
    assert data["command"] == "test command" and len(data["points"]) == 2
    assert (d / "curve.png").exists() and "| 4 |" in (d / "curve.md").read_text()
    # per-prompt counts add up to the point's totals, so points pair up across curves
    for p in pts:
        assert [s["prompt"] for s in p.samples] == [0, 1]
        assert sum(s["new_tokens"] for s in p.samples) == p.new_tokens
        assert p.tau == sum(s["new_tokens"] for s in p.samples) / sum(s["target_forwards"] for s in p.samples)
        for s in p.samples:
            assert all(0 <= a <= r for a, r in zip(s["accepted_per_pos"], s["reached_per_pos"]))
    import pytest

    only = learning_curve(out, target, tok, prompts, gamma=3, max_new_tokens=6, progress=False, log=lambda *_: None,
                          steps=[4], categories=["x", "y"])
    assert [p.step for p in only] == [4] and only[0].samples == [{**s, "category": c} for s, c in
                                                                zip(pts[1].samples, "xy")]
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step\(s\) \[3\]; it keeps \[2, 4\]"):
        learning_curve(out, target, tok, prompts, gamma=3, max_new_tokens=6, progress=False, steps=[3])
    # scripts/compare_evals.py reads a curve point as a run: CURVE_DIR@STEP, paired by prompt
    from specdistill.cli.compare_evals import main as compare

    write_curve(pts, tmp_path / "curve", "test command", label="tiny",
                extra={"prompts": "p", "num_prompts": 2, "gamma": 3, "max_new_tokens": 6, "temperature": 0.0})
    res = compare([f"{d}@2", f"{d}@4", f"{d}", "--out", str(tmp_path / "cmp")])["overall"]
    assert res[f"{d}@4"]["tau"] == pts[1].tau and res[f"{d}@2"]["tau"] == pts[0].tau
    assert res[f"{d}"]["tau"] == pts[1].tau  # no @STEP: the last point
    with pytest.raises(ValueError, match=r"scored steps \[2, 4\], not 3"):
        compare([f"{d}@2", f"{d}@3", "--out", str(tmp_path / "cmp")])


def test_heldout_curve_reads_the_in_training_proxy(tmp_path):
    import json

    import pytest

    from specdistill.pipeline.curve import heldout_curve

    rows = [{"step": 8, "train/loss": 3.0, "tokens_seen": 100},
            {"step": 16, "tokens_seen": 200, "wall_s": 120.0, "heldout/mean_accept_len": 1.25,
             "heldout/accept_rate_per_pos": [0.2, 0.1], "heldout/num_positions": 50},
            {"step": 32, "tokens_seen": 400, "wall_s": 240.0},
            {"step": 32, "heldout/mean_accept_len": 1.5}]  # the loop writes eval lines after the step's train line
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pts = heldout_curve(tmp_path)
    assert [(p.step, p.tokens_seen, p.tau) for p in pts] == [(16, 200, 1.25), (32, 400, 1.5)]
    assert pts[0].wall_minutes == 2.0 and pts[0].accept_rate_per_pos == [0.2, 0.1]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="held-out"):
        heldout_curve(tmp_path)
