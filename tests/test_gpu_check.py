"""scripts/gpu_check.py: its verdicts on hand-made inputs (efficiency figures against floors, compile checks, every
stage error and failed check in `problems`, `ok` exactly when it is empty), its decoding stages on toy models with
dynamo really compiling (inductor's code generation replaced by running the traced graph: the plumbing, not
inductor's kernels) and with a compile that compiles nothing, and (slow, ~2.5 min here) the whole CPU fallback."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def graphs_run_as_traced(monkeypatch):
    """Inductor's code generation replaced by running the graph dynamo traced: dynamo compiles, guards and counts as
    always (and the decoders' counting backend around inductor counts too), without C++ kernel builds."""
    import torch._inductor.compile_fx

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lambda gm, example_inputs, **kwargs: gm.forward)


# ------------------------------------------------------------------------------------------------ efficiency
def test_a_figure_fails_below_its_floor_only_when_judged(gc):
    limit = gc.Limit(100.0, "published")
    low = gc.Figure(20.0, limit, "B/s", floor=0.25, judged=True)
    assert low.fraction == 0.2 and low.ok is False and "below the floor 0.25" in low.to_dict()["problems"][0]
    assert gc.Figure(30.0, limit, "B/s", floor=0.25, judged=True).to_dict()["problems"] == []
    assert gc.Figure(20.0, limit, "B/s", floor=0.25, judged=False).ok is None  # the CPU: reported, not judged
    assert gc.Figure(20.0, limit, "B/s", floor=None, judged=True).ok is None
    unknown = gc.Figure(20.0, gc.Limit(None, "unknown"), "B/s", floor=0.25, judged=True)
    assert unknown.fraction is None and unknown.ok is None and unknown.to_dict()["problems"] == []


def test_decode_step_cost_counts_weights_once_and_each_rows_cache(gc):
    one = gc.decode_step_cost(1000, 2, layers=2, heads=4, kv_heads=2, head_dim=8, batch=1, context=10)
    four = gc.decode_step_cost(1000, 2, layers=2, heads=4, kv_heads=2, head_dim=8, batch=4, context=10)
    kv_per_row = 2 * 2 * 2 * 8 * 10 * 2  # keys and values x layers x kv heads x head_dim x tokens x bytes
    assert one.bytes == 1000 * 2 + kv_per_row and four.bytes - one.bytes == 3 * kv_per_row
    assert four.flops == 4 * one.flops


def test_decode_efficiency_judges_the_binding_limit(gc):
    cost = gc.DecodeCost(bytes=1e9, flops=1e9)
    bw, peak = gc.Limit(1e12, "sheet"), gc.Limit(1e15, "sheet")
    memory = gc.decode_efficiency(cost, 100.0, bw, peak, 0.3, judged=True)  # 1 ms of bytes vs 1 us of FLOPs
    assert memory["bound"] == "memory" and memory["bandwidth"]["floor"] == 0.3 and memory["compute"]["floor"] is None
    assert memory["bandwidth"]["fraction"] == pytest.approx(0.1) and memory["bandwidth"]["ok"] is False
    compute = gc.decode_efficiency(gc.DecodeCost(bytes=1e3, flops=1e13), 50.0, bw, peak, 0.3, judged=True)
    assert compute["bound"] == "compute" and compute["compute"]["ok"] is True  # 1e13 x 50 = 0.5 of 1e15
    unknown = gc.decode_efficiency(cost, 100.0, bw, gc.Limit(None, "unknown"), 0.3, judged=True)
    assert unknown["bound"] == "memory"


def test_params_read_per_step_leaves_out_an_untied_input_embedding(gc):
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (True, False):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))
        total = sum(p.numel() for p in model.parameters())
        assert gc.params_read_per_step(model) == (total if tied else total - 50 * 16)


# ------------------------------------------------------------------------------------------------ compiling
def test_compile_check_fails_a_path_that_compiled_nothing_hit_the_limit_skipped_cuda_graphs_or_compiled_late(gc):
    C = gc.CompileCount
    assert gc.CompileCheck(C(2, 2), C(), {}).problems() == []
    assert "compiled nothing" in gc.CompileCheck(C(), C(), {}).problems()[0]
    assert "recompile limit" in gc.CompileCheck(C(3, 3, limit_hits=1), C(), {}).problems()[0]
    assert "CUDA graph capture" in gc.CompileCheck(C(2, 2, cudagraph_skips=1), C(), {}).problems()[0]
    after = gc.CompileCheck(C(2, 2), C(1, 1), {}).to_dict()
    assert not after["ok"] and "after the warm-up" in after["problems"][0]
    # the decoders' count decides whether anything compiled, and names graphs compiled twice
    from specdistill.decoding import CompileStats

    assert "compiled nothing" in gc.CompileCheck(C(0, 3, decoder=0), C(decoder=0), {}).problems()[0]
    twice = CompileStats(model="m", compiles={"batch16_width1_len256": 2})
    assert "more than once" in gc.CompileCheck(C(0, 2, decoder=2), C(decoder=0), {}, {"0:m": twice}).problems()[0]


def test_compile_count_reads_dynamo_compiles_and_recompile_limit_hits(gc):
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        _, first = gc.counted(lambda: f(torch.ones(1)))
        _, again = gc.counted(lambda: f(torch.ones(1)))
        assert first.graphs == 1 and again == gc.CompileCount()
        _, past = gc.counted(lambda: [f(torch.ones(n)) for n in (2, 3, 4)])  # a third shape passes the limit of 2
    assert past.graphs == 1 and past.limit_hits >= 1
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ the report
def test_every_stage_error_and_failed_check_lands_in_problems(gc, tmp_path):
    report = gc.Report(tmp_path / "gpu_check.json", {}, 100.0, {})
    assert report.stage("fine", lambda: {"x": 1}, "cpu") is not None

    def boom() -> dict:
        raise ValueError("the cache overflowed")

    assert report.stage("broken", boom, "cpu") is None
    verdict = {"ok": False, "precision": "bf16", "rows": 2, "identical_rows": 1, "rounding": 0, "beyond_noise": 1,
               "noise": {"bound": 0.5}, "divergences": [{"fp32_margin": 3.0}], "problems": ["row 1 token 4: ..."]}
    figure = gc.Figure(1.0, gc.Limit(10.0, "sheet"), "B/s", 0.3, True).to_dict()
    report.stage("decode", lambda: {"lossless": {"static_vs_growing": verdict}, "efficiency": {"batch2": figure},
                                    "compiled": {"skipped": "budget"}}, "cpu")
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["ok"] is False and len(data["problems"]) == 3
    assert data["problems"][0] == "broken: ValueError: the cache overflowed"
    assert data["problems"][1] == "decode.lossless.static_vs_growing: row 1 token 4: ..."
    assert data["problems"][2].startswith("decode.efficiency.batch2: ")
    assert data["skipped"] == ["decode.compiled: budget"]
    assert data["stages"]["fine"]["ok"] and not data["stages"]["broken"]["ok"] and not data["stages"]["decode"]["ok"]
    assert data["lossless"]["decode.lossless.static_vs_growing"]["largest_fp32_margin"] == 3.0
    assert data["efficiency"]["decode.efficiency.batch2"]["fraction"] == pytest.approx(0.1)
    clean = gc.Report(tmp_path / "clean.json", {}, 100.0, {})
    clean.stage("fine", lambda: {"lossless": {"a_vs_b": {**verdict, "ok": True, "problems": []}}}, "cpu")
    assert json.loads((tmp_path / "clean.json").read_text())["ok"] is True


def test_skip_names_only_stages_and_says_which_exist(gc, tmp_path, capsys):
    with pytest.raises(SystemExit):
        gc.main(["--device", "cpu", "--tiny", "--skip", "eagle3,training", "--work", str(tmp_path / "w")])
    assert "--skip training: no such stage" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before any work


# ------------------------------------------------------------------------------------------------ toy models
@pytest.fixture(scope="module")
def toy_target(gc, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_check") / "target"
    torch.set_num_threads(1)
    gc.make_model(folder, gc.tiny_sizes().big, "cpu")
    return folder


def test_regenerate_compiles_once_decodes_losslessly_and_reports_its_efficiency(gc, toy_target, monkeypatch):
    graphs_run_as_traced(monkeypatch)
    sizes = gc.tiny_sizes()
    out = gc.regeneration_rate(toy_target, sizes, "cpu", lambda: True, gc.device_limits("cpu"))
    assert out["compile"]["ok"], out["compile"]
    assert out["compile"]["warm"]["graphs"] > 0 and out["compile"]["timed"]["graphs"] == 0
    for B in sizes.regen_batches:
        for mode in ("static", "compiled"):
            verdict = out["lossless"][f"batch{B}_{mode}_vs_growing"]
            assert verdict["ok"] and verdict["precision"] == "bf16" and verdict["noise"]["plausible"], verdict
        for mode in ("growing", "static", "compiled"):
            figure = out["efficiency"][f"batch{B}_{mode}"]["bandwidth"]
            assert figure["value"] > 0 and 0 < figure["fraction"] and figure["ok"] is None  # CPU: not judged


def test_a_compile_that_compiles_nothing_is_a_problem(gc, toy_target, monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn)
    report = gc.Report(tmp_path / "gpu_check.json", {}, 100.0, {})
    report.stage("regenerate", lambda: gc.regeneration_rate(toy_target, gc.tiny_sizes(), "cpu", lambda: True, None),
                 "cpu")
    problems = report.data["problems"]
    # the compile check names it, or the decoders fail on a step that never went through dynamo: a problem either way
    assert not report.data["ok"] and any(p.startswith("regenerate.compile: compiled nothing")
                                         or p.startswith("regenerate: ") for p in problems), problems


def test_fp32_stage_decodes_token_identically_on_every_path(gc, toy_target, monkeypatch, tmp_path):
    graphs_run_as_traced(monkeypatch)
    sizes = gc.tiny_sizes()
    data = tmp_path / "conversations.jsonl"
    gc.write_conversations(data, sizes, sizes.big["vocab_size"])
    out = gc.exact_decoding(toy_target, None, data, sizes, "cpu", lambda: True)
    assert out["tf32"] == {"matmul_allow_tf32": False, "cudnn_allow_tf32": False}
    assert set(out["lossless"]) == {"static_vs_growing", "compiled_vs_growing"}
    assert all(v["ok"] and v["precision"] == "fp32" for v in out["lossless"].values()), out["lossless"]
    assert out["compile"]["ok"] and "skipped" in out["speculative"]
    assert torch.backends.cuda.matmul.allow_tf32 is not None  # restored, whatever it was


# ------------------------------------------------------------------------------------------------ the whole run
@pytest.mark.slow
def test_the_gpu_check_passes_on_the_cpu_at_toy_sizes(gc, tmp_path, monkeypatch):
    graphs_run_as_traced(monkeypatch)
    rc = gc.main(["--device", "cpu", "--tiny", "--compile", "on", "--budget-s", "1000",
                  "--work", str(tmp_path / "work"), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = report["stages"]
    assert rc == 0 and report["ok"] and report["problems"] == [], json.dumps(report["problems"], indent=1)[:4000]
    assert set(stages) == {"assets", "limits", "eagle3", "draft_opd", "opd_cost", "evaluate", "lossless_fp32",
                           "regenerate"}
    assert stages["eagle3"]["steps"] == 4 and stages["eagle3"]["tokens_per_s"] > 0
    profile = stages["eagle3"]["profile"]  # steps 2-3 profiled: where the time went, MFU's factors
    assert profile["steps"] == 2 and profile["share_of_busy"]["matmul"] > 0 and set(profile["factors"]) >= {"mfu"}
    assert stages["draft_opd"]["steps"] == 2 and stages["draft_opd"]["tokens_per_s"] > 0  # step 2: not FLOP-counted
    opd = stages["opd_cost"]
    assert opd["step_ratio_per_row"] > 0 and not opd["judged"] and opd["problems"] == []
    assert opd["rollout_decoding"] == "growing"  # the CPU fallback; CUDA runs the rollouts compiled
    arms = opd["arms"]
    assert arms["onpolicy"]["target_forwards_per_step"] > 0 == arms["offpolicy"]["target_forwards_per_step"]
    assert stages["evaluate"]["speedup"] > 0 and stages["evaluate"]["compiled"]["compile"]["ok"]
    assert set(report["compile"]) == {"evaluate.compiled.compile", "lossless_fp32.compile", "regenerate.compile"}
    assert all(c["graphs"] > 0 and c["graphs_after_warm_up"] == 0 for c in report["compile"].values())
    assert {"evaluate.lossless.speculative_vs_target_only", "evaluate.compiled.lossless.speculative_vs_target_only",
            "lossless_fp32.lossless.compiled_speculative_vs_growing",
            "regenerate.lossless.batch4_compiled_vs_growing"} <= set(report["lossless"])
    assert report["efficiency"]["eagle3.efficiency.mfu"]["floor"] == report["floors"]["mfu"]
