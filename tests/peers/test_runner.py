"""The peer runner's pure parts, importable without any peer: the speculators flags each arm gets, the learning-rate
schedules of the driven loops, and the epoch-end head bookkeeping that keeps saving out of the training time."""
from __future__ import annotations

import time
from dataclasses import asdict

import pytest

from benchmarks.peers import arms
from benchmarks.peers.peer_train import Points, lr_factor, speculators_argv


def spec_for(kind: str) -> dict:
    return {"peer": "speculators", "arm": kind, "settings": asdict(arms.settings_for("speculators", kind)),
            "target": "/t", "data": {"root": "/d", "d2t_path": "/d/d2t-8192.npy", "t2d_path": "/d/t2d-8192.npy",
                                     "train_data_ratio": 0.97},
            "out": "/o", "epochs": 6, "seed": 0, "draft_vocab_size": 8192,
            "peer_aux_ids": arms.peer_aux_ids("speculators", (2, 15, 27)), "tokens_per_step": 1500}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_speculators_arm_at_our_settings_trains_the_served_layout():
    argv = speculators_argv(spec_for("ours"))
    assert {"--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"} <= set(argv)
    assert flag(argv, "--ttt-steps") == "4" and flag(argv, "--ttt-step-loss-decay") == "0.8"
    assert flag(argv, "--optimizer") == "adamw" and flag(argv, "--scheduler-type") == "none"
    assert flag(argv, "--full-attention-indices") == "0"
    i = argv.index("--target-layer-ids")
    assert argv[i + 1: i + 4] == ["2", "15", "27"]  # vLLM's convention, as ours
    # CPU flags: no Triton loss, no flex attention, fp32 features, no dataloader workers
    assert flag(argv, "--loss-implementation") == "eager" and flag(argv, "--draft-attn-impl") == "sdpa"
    assert flag(argv, "--hidden-states-dtype") == "float32" and flag(argv, "--num-workers") == "0"
    assert flag(argv, "--d2t-path").endswith("d2t-8192.npy") and flag(argv, "--draft-vocab-size") == "8192"


def test_speculators_one_row_arm_trains_the_served_layout_too():
    one, ours = speculators_argv(spec_for("ours-1row")), speculators_argv(spec_for("ours"))
    assert one == ours  # the rows per step reach speculators as tokens_per_step, which the runner sets
    assert flag(one, "--full-attention-indices") == "0"


def test_speculators_defaults_keep_its_norms_optimizer_and_depth():
    argv = speculators_argv(spec_for("defaults"))
    assert {"--norm-before-residual", "--norm-before-fc", "--norm-output"} <= set(argv)
    assert flag(argv, "--optimizer") == "muon" and flag(argv, "--ttt-steps") == "3"
    assert flag(argv, "--scheduler-type") == "linear" and "--full-attention-indices" not in argv


def test_lr_factor_warms_up_then_follows_the_schedule():
    assert lr_factor(0, 100, 10, "constant") == pytest.approx(0.1)
    assert lr_factor(50, 100, 10, "constant") == 1.0
    assert lr_factor(10, 100, 10, "linear") == 1.0 and lr_factor(100, 100, 10, "linear") == 0.0
    assert lr_factor(55, 100, 10, "cosine") == pytest.approx(0.5)


def test_points_leave_saving_out_of_the_training_time(tmp_path):
    pts, t0 = Points(tmp_path), time.perf_counter()
    pts.save(1, t0, 100, lambda folder: time.sleep(0.2))
    assert pts.wall(t0) < 0.1 and pts.rows[0]["train_s"] < 0.1  # the 0.2 s save is not training time
    assert pts.rows[0] == {**pts.rows[0], "epoch": 1, "loss_tokens": 100, "dir": str(tmp_path / "epochs" / "1")}


def test_report_lists_every_arm_its_failures_curves_and_vllm(tmp_path):
    import json

    from benchmarks.peers.run import write_report

    ev = {"tau": 2.5, "accept_rate_per_pos": [0.8, 0.6, 0.5, 0.4], "dir": str(tmp_path)}
    results = {"mode": "tiny", "command": "python -m benchmarks.peers.run --tiny", "budget": "1 epoch(s) per arm",
               "rows": 15, "loss_tokens": 360, "settings": ["T0-g4"], "paired": {"T0-g4": None}, "arms": {
                   "specdistill": {"evals": {"T0-g4": ev}, "loss_tokens_per_s": 100.0, "wall_s": 3.6,
                                   "vllm": {"tau": 2.4, "ours_tau": 2.5},
                                   "tau_curve": [{"loss_tokens": 360, "train_s": 3.6, "tau": 2.5}]},
                   "speculators-defaults": {"evals": {"T0-g4": ev}, "wall_s": 9.0, "peak_rss_mb": 900,
                                            "conversion": {"exact": False, "inexact": ["norm_output: fed back"],
                                                           "agreement_with_peer_forward": 0.25}},
                   "specforge-defaults": {"curve": [[1.6, 1, 22.3]]},  # a peer's own training-loss curve
                   "modelopt-ours": {"rc": 1, "error": "RuntimeError: boom"}}}
    write_report(tmp_path, results)
    md = (tmp_path / "results.md").read_text()
    assert "| specdistill | 2.5000 | 0.800, 0.600, 0.500, 0.400 | 100.0 | 3.6 |" in md
    assert "| speculators-defaults | 2.5000 |" in md and "0.250 | approx: norm_output |" in md
    assert "modelopt-ours | failed: 'RuntimeError: boom'" in md
    assert "Served by vLLM" in md and "(360, 3.6, 2.500)" in md and "Command: `python -m benchmarks.peers.run" in md
    assert json.loads((tmp_path / "results.json").read_text())["arms"]["specdistill"]["vllm"]["tau"] == 2.4


def test_epoch_steps_shuffles_each_epoch_and_stops_at_the_wall_budget():
    import random

    from benchmarks.peers.peer_train import epoch_steps

    got = [(e, [list(r) for r in steps]) for e, steps in epoch_steps(7, 2, 3, {"epochs": 2}, random.Random(0))]
    rng = random.Random(0)
    want = []
    for e in range(2):
        order = list(range(7))
        rng.shuffle(order)
        want.append((e, [order[b * 2:(b + 1) * 2] for b in range(3)]))
    assert got == want
    late = [list(steps) for _, steps in epoch_steps(7, 2, 3, {"epochs": 2, "wall_seconds": -1.0}, random.Random(0))]
    assert late == []  # a budget already spent: no epoch starts


def test_speculators_loader_counts_only_the_loss_tokens_it_hands_to_the_trainer():
    """An epoch cut short by the wall budget reports the loss tokens of the batches trained on, not the epoch's."""
    import torch

    from benchmarks.peers.shims import speculators as shim

    batches = [{"loss_mask": torch.tensor([[0, 1, 1, 0]], dtype=torch.bool)},
               {"loss_mask": torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)}]
    shim.LOSS_TOKENS["seen"] = 0
    assert len(list(shim.DeadlineLoader(batches))) == 2 and shim.LOSS_TOKENS["seen"] == 5
    shim.LOSS_TOKENS["seen"] = 0
    assert list(shim.DeadlineLoader(batches, deadline=time.time() - 1)) == []  # budget spent: nothing trained
    assert shim.LOSS_TOKENS["seen"] == 0
    with pytest.raises(RuntimeError, match="loss_mask"):
        list(shim.DeadlineLoader([{"input_ids": torch.zeros(1, 3)}]))
