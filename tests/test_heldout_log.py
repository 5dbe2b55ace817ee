"""train/heldout_log.py: a run's held-out evaluations, each at the counters of the training line above it."""
import json

from specdistill.train.heldout_log import HeldoutPoint, read_heldout_log


def _write(run, lines, summary=None):
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines) + "\n\n")  # a blank last line
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))


def test_each_evaluation_takes_the_last_training_lines_counters(tmp_path):
    held = {"heldout/mean_accept_len": 1.5, "heldout/accept_rate_per_pos": [0.4, 0.1], "heldout/num_positions": 30}
    _write(tmp_path, [
        {"step": 0, **held, "heldout/mean_accept_len": 9.0},          # before any training line: no counters, left out
        {"step": 4, "train/loss": 2.0, "tokens_seen": 40, "wall_s": 6.0, "phase": "warmup"},
        {"step": 4, "phase": "warmup", **held},
        {"step": 8, "train/loss": 1.0, "tokens_seen": 80},            # no wall_s: the last one stands
        {"step": 8, "phase": "main", **held, "heldout/mean_accept_len": 2.0},
        {"step": 9, "train/loss": 0.5, "tokens_seen": 90, "wall_s": 12.0},
    ], summary={"heldout_before": {"heldout/mean_accept_len": 1.1}})
    log = read_heldout_log(tmp_path)
    assert log.points == [HeldoutPoint(0, 0, 0.0, 1.1, [], "before"),
                          HeldoutPoint(4, 40, 6.0, 1.5, [0.4, 0.1], "warmup", 30),
                          HeldoutPoint(8, 80, 6.0, 2.0, [0.4, 0.1], "main", 30)]
    assert (log.last_step, log.tokens_seen, log.wall_s) == (9, 90, 12.0)
    assert read_heldout_log(tmp_path, before=False).points == log.points[1:]


def test_a_run_without_summary_or_evaluations_has_no_points(tmp_path):
    _write(tmp_path, [{"step": 1, "train/loss": 2.0, "tokens_seen": 10, "wall_s": 1.0}])
    log = read_heldout_log(tmp_path)
    assert log.points == [] and (log.last_step, log.tokens_seen, log.wall_s) == (1, 10, 1.0)
