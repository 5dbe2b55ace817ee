"""trainer.profile_steps: where a step's device time goes, MFU split into its factors, and the profiled steps kept
out of the logged rates."""
import json
import time
from contextlib import contextmanager

import pytest

from specdistill.train import profile as step_profile
from specdistill.train.profile import Work, kernel_group, op_group, summarize

# kernel names as an H100/H200 run of torch's CUDA build shows them
KERNELS = {
    "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel":
        "matmul",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(...)": "matmul",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(...)": "attention",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::LogSoftMaxForwardEpilogue>(...)": "softmax / log_softmax",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>(...)":
        "elementwise / fused",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<...>>>(...)":
        "reductions",
    "Memcpy HtoD (Pinned -> Device)": "copies / indexing",
    "void at::native::index_elementwise_kernel<128, 4, ...>(...)": "copies / indexing",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>(...)": "optimizer",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "elementwise / fused",
}


@pytest.mark.parametrize("name,group", KERNELS.items())
def test_cuda_kernels_fall_in_their_group(name, group):
    assert kernel_group(name) == group


def test_cpu_operators_fall_in_their_group():
    assert op_group("aten::addmm") == "matmul" and op_group("aten::_scaled_dot_product_flash_attention_for_cpu") \
        == "attention"
    assert op_group("aten::_log_softmax") == "softmax / log_softmax" and op_group("aten::topk") == "other"
    assert op_group("aten::index_select") == "copies / indexing" and op_group("aten::mul") == "other"


def test_a_host_bound_step_reads_as_an_idle_device_and_a_slow_one_as_slow_kernels():
    peak = 1000e12
    # host-bound: 1 s of wall, the device busy 0.2 s, all of it matmuls at the peak
    idle = summarize([Work("nvjet_a", 0.2, 10)], "cuda", 1, 1.0, flops=0.2 * peak, peak_flops_per_s=peak)
    assert idle.busy_fraction == pytest.approx(0.2) and idle.factors["matmul_rate_of_peak"] == pytest.approx(1.0)
    assert idle.factors["mfu"] == pytest.approx(0.2)
    # device-bound: busy all the time, half of it elementwise work, the matmuls at half the peak
    slow = summarize([Work("nvjet_a", 0.5, 10), Work("vectorized_elementwise_kernel", 0.5, 99)], "cuda", 1, 1.0,
                     flops=0.25 * peak, peak_flops_per_s=peak)
    assert slow.busy_fraction == pytest.approx(1.0)
    assert slow.factors["matmul_rate_of_peak"] == pytest.approx(0.5)
    assert slow.factors["matmul_share_of_busy"] == pytest.approx(0.5)
    f = slow.factors  # the factors multiply to MFU
    assert f["matmul_rate_of_peak"] * f["matmul_share_of_busy"] * f["busy_fraction"] == pytest.approx(f["mfu"])
    # without the FLOPs or the peak there are no factors, the breakdown stays
    assert summarize([Work("nvjet_a", 0.5, 1)], "cuda", 1, 1.0).factors == {}


def test_profiled_steps_write_the_breakdown_and_stay_out_of_the_logged_rates(tiny_target_dir, tiny_data_file,
                                                                           tmp_path, monkeypatch):
    from specdistill.build import build
    from specdistill.train.loop import fit
    from tests.conftest import compose, tiny_overrides

    real, pause = step_profile.profiling, 1.5

    @contextmanager
    def slow_profiling(device):  # a profiler that costs seconds: the logged rates must not see them
        with real(device) as box:
            yield box
            time.sleep(pause)

    monkeypatch.setattr(step_profile, "profiling", slow_profiling)
    out = tmp_path / "run"
    cfg = compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache")
                  + ["trainer.max_steps=6", "trainer.grad_accum=1", "trainer.profile_steps=2", "trainer.log_every=3",
                     "trainer.eval_every=0",
                     "objective.compile_loss=false"])  # a compile in the first plain step would blur its rate
    fit(build(cfg))
    prof = json.loads((out / "profile.json").read_text())
    assert prof["steps"] == 2 and prof["steps_profiled"] == [2, 4] and prof["device"] == "cpu"
    assert prof["wall_s"] >= 2 * pause and prof["groups_s"]["matmul"] > 0 and prof["top"]
    assert set(prof["factors"]) == {"mfu", "matmul_rate_of_peak", "matmul_share_of_busy", "busy_fraction"}
    assert "| where the device's time goes |" in (out / "profile.md").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [3, 6]
    # windows of 3 steps each, one or two of them profiled: the rates are the other steps' (a tiny step takes well
    # under the profiler's pause)
    assert all(r["train/s_per_step"] < pause / 2 for r in train), [r["train/s_per_step"] for r in train]
    assert all(0 < r["train/mfu"] < 1 for r in train)


def test_the_flop_counted_step_stays_out_of_the_logged_rates(tiny_target_dir, tiny_data_file, tmp_path, monkeypatch):
    """The first step runs under torch's FLOP counter, which slows it (on-policy steps by half on a CPU): its row
    logs the loss but no rate, and the later windows' rates are the plain steps'."""
    from specdistill.build import build
    from specdistill.train import loop
    from tests.conftest import compose, tiny_overrides

    real, pause = loop.count_flops, 1.5

    def slow_count(fn):
        time.sleep(pause)
        return real(fn)

    monkeypatch.setattr(loop, "count_flops", slow_count)
    out = tmp_path / "run"
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache")
                  + ["trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0"])
    fit_result = loop.fit(build(cfg))
    train = [h for h in fit_result.history if "train/loss" in h]
    assert [h["step"] for h in train] == [1, 2, 3]
    assert train[0]["train/instrumented"] and "train/tokens_per_s" not in train[0] and "train/mfu" not in train[0]
    assert all(h["train/s_per_step"] < pause / 2 and 0 < h["train/mfu"] < 1 for h in train[1:])
