"""The throughput counter: torch's FLOP count of a known step, the roofline arithmetic, and the loop logging it."""
import json

import torch

from specdistill.train.throughput import Roofline, count_flops, matmul_gflops


def test_count_flops_of_a_linear_forward_backward_is_6_b_in_out():
    torch.manual_seed(0)
    B, n_in, n_out = 7, 13, 5
    lin = torch.nn.Linear(n_in, n_out, bias=False)
    x = torch.randn(B, n_in, requires_grad=True)
    counted = count_flops(lambda: lin(x).sum().backward())
    # forward 2*B*in*out; backward: grad of x and grad of W, 2*B*in*out each
    assert counted.flops == 6 * B * n_in * n_out


def test_roofline_arithmetic():
    r = Roofline(peak_gflops=40.0, flops_per_token=2e8)
    assert r.achieved_gflops(100.0) == 20.0
    assert r.fraction(100.0) == 0.5
    m = r.metrics(100.0)
    assert m["train/roofline_fraction"] == 0.5 and m["train/flops_per_token"] == 2e8


def test_matmul_microbenchmark_is_positive_and_finite():
    g = matmul_gflops("cpu", n=128, seconds=0.02)
    assert 0 < g < 1e5


def test_the_loop_logs_flops_per_token_and_roofline(tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.build import build
    from specdistill.train.loop import fit
    from tests.conftest import compose, tiny_overrides

    cfg = compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "run", tmp_path / "cache")
                  + ["trainer.max_steps=2", "trainer.grad_accum=1"])
    fit(build(cfg))
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert train and all(r["train/flops_per_token"] > 0 and r["train/roofline_fraction"] > 0 for r in train)
    # a per-token count: the EAGLE-3 step costs at least the head's matmuls over its unrolled steps
    head_params = sum(p.numel() for n, p in build(cfg).models.draft.named_parameters() if p.requires_grad)
    assert train[0]["train/flops_per_token"] > 2 * head_params
