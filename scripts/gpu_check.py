"""The CUDA path on one GPU, checked in one run (scripts/gpu_check.sh wraps it; docs/gpu_check.md explains it).

Random-weight models of real shapes, built from configs (no model hub): SmolLM2-135M, and a Llama-3.1-8B-shaped
target with a few layers. Stages, each timed and recorded, a failure recorded without stopping the others:
  1. eagle3         recipe=eagle3 on the 8B-shaped target, bf16 mixed precision, 20 steps (train.py, a subprocess):
                    tokens/s, and MFU against the device's dense bf16 peak
  2. draft_opd      recipe=draft_opd, two on-policy steps of an EAGLE-3 head on the SmolLM2-shaped target, bf16
  3. evaluate       the evaluator in bf16 on the 8B-shaped target with the head of stage 1 (speedup, tau); speculative
                    against target-only decoding judged lossless (eval/lossless.py: each divergence's fp32 margin
                    against the paths' measured bf16 noise); then the same with compiled static caches (CUDA graphs),
                    which must compile, and compile nothing more once warm
  4. lossless_fp32  the 8B-shaped target and the head in fp32 with TF32 off: growing, static and compiled caches and
                    speculative decoding must give token-identical output (any difference fails)
  5. regenerate     target-only decoding with feature capture, as regeneration runs it, at batch 16 and 128: tokens/s
                    and the fraction of the device's memory bandwidth (or compute) per cache mode; static and compiled
                    caches judged lossless against the growing cache as in 3
  6. opd_cost       benchmarks/opd_cost.py: a Draft-OPD step (64-token rollouts at T=1) against recipe eagle3_serve's
                    off-policy step on the same rows (both from one regenerated store), per row; the goal is <= 3x.
                    Last, and skipped (said so) when under 90 s of --budget-s are left
Writes gpu_check.json to --out, else $OUT, else the work folder: every figure, `problems` (each failed stage or check,
named) and `ok` (true exactly when `problems` is empty), and digests `lossless`, `compile` and `efficiency`.

  python scripts/gpu_check.py                       # one GPU, under 8 minutes on an H200
  python scripts/gpu_check.py --device cpu --tiny   # the same stages at toy sizes on the CPU, in about two minutes
Exit status: 0 when `problems` is empty, 1 when not, 2 when the machine lacks what the check needs.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # annotations only: specdistill is imported once main has found it installed
    from specdistill.config import Config

REPO = Path(__file__).resolve().parent.parent
# What the checked paths import; torch is checked apart (its CUDA build matters).
REQUIRED = {"transformers": "transformers", "accelerate": "accelerate", "datasets": "datasets", "hydra": "hydra-core",
            "omegaconf": "omegaconf", "safetensors": "safetensors", "tokenizers": "tokenizers",
            "huggingface_hub": "huggingface_hub", "tqdm": "tqdm"}  # module -> pip name
SHARPEN = 8.0  # lm_head scale: peaked distributions, so fewer greedy argmaxes sit at a near-tie
# Efficiency floors (fractions of the device's limit) below which a CUDA run fails; on the CPU figures are reported.
MFU_FLOOR = 0.25             # eagle3 training: achieved FLOP/s over the dense bf16 peak
DECODE_FLOORS = {"growing": 0.10, "static": 0.10, "compiled": 0.30}  # decoding: of the binding limit (bandwidth)
# Draft-OPD: an on-policy step over an off-policy step at equal rows. The goal, and the ceiling a CUDA run fails above.
OPD_STEP_GOAL, OPD_STEP_CEILING = 3.0, 6.0
# Memory bandwidth from the datasheets (name contained, names excluded, bytes/s); other devices use the measured copy.
PUBLISHED_BANDWIDTH = (("H200", ("NVL",), 4.8e12), ("H100", ("NVL", "PCIe"), 3.35e12),
                       ("A100", ("PCIe", "40GB"), 2.039e12))
NOISE_ROWS = 16  # rows whose bf16 noise is measured teacher-forced (eval/lossless.py)
OPTIONAL_STAGES = ("eagle3", "draft_opd", "opd_cost", "evaluate", "lossless_fp32", "regenerate")  # after assets, limits
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "user", "assistant", "system"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class Sizes:
    """Everything the check sizes: models, data, steps, decoding lengths."""
    small: dict           # SmolLM2-135M-shaped LlamaConfig fields
    big: dict             # Llama-3.1-8B-shaped LlamaConfig fields (a few layers)
    rows: int             # training conversations
    answer_words: tuple   # (min, max) words per assistant turn
    max_length: int       # data.max_length
    micro_batch: int
    steps: int            # eagle3 training steps
    draft_vocab: int
    eval_prompts: int
    eval_new_tokens: int
    compile_prompts: int
    regen_batches: tuple
    regen_prompt: int
    regen_new_tokens: int
    opd_new_tokens: int = 64   # Draft-OPD rollout length in opd_cost
    opd_prompts: int = 64      # prompts regenerated for opd_cost's shared store


def real_sizes(layers: int, steps: int) -> Sizes:
    smollm2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)
    llama8b = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    return Sizes(smollm2, llama8b, rows=320, answer_words=(300, 900), max_length=1024, micro_batch=8, steps=steps,
                 draft_vocab=32000, eval_prompts=16, eval_new_tokens=128, compile_prompts=4,
                 regen_batches=(16, 128), regen_prompt=128, regen_new_tokens=128)


def tiny_sizes() -> Sizes:
    base = dict(vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5, num_attention_heads=4,
                num_key_value_heads=2)
    small = dict(base, hidden_size=64, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True)
    big = dict(base, hidden_size=128, intermediate_size=256, num_hidden_layers=4, tie_word_embeddings=False)
    return Sizes(small, big, rows=40, answer_words=(20, 40), max_length=96, micro_batch=2, steps=4, draft_vocab=256,
                 eval_prompts=2, eval_new_tokens=12, compile_prompts=1, regen_batches=(2, 4), regen_prompt=8,
                 regen_new_tokens=8, opd_new_tokens=8, opd_prompts=8)


# ------------------------------------------------------------------------------------------------ the machine
def missing_packages() -> list[str]:
    """pip names of the required packages this Python cannot import."""
    return [pip for module, pip in REQUIRED.items() if importlib.util.find_spec(module) is None]


def environment(device: str) -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported())
    return env


def peak_memory_mb(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


# ------------------------------------------------------------------------------------------------ assets
def make_tokenizer(vocab_size: int):
    """A word-level chat tokenizer of exactly vocab_size ids: the specials, then words w7, w8, ... (real-size
    embeddings and draft vocabularies without a hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    return fast


def write_conversations(path: Path, sizes: Sizes, vocab_size: int, seed: int = 0) -> None:
    """ShareGPT rows of Zipf-distributed words (the frequent words make the draft vocabulary, as in real text)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(len(SPECIALS), vocab_size)
    probs = 1.0 / (torch.arange(len(ids), dtype=torch.float64) + 10.0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in ids[torch.multinomial(probs, n, replacement=True, generator=g)])

    lo, hi = sizes.answer_words
    with path.open("w") as f:
        for r in range(sizes.rows):
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            turns = [{"from": "human", "value": words(int(torch.randint(10, 40, (1,), generator=g)))},
                     {"from": "gpt", "value": words(n)}]
            f.write(json.dumps({"id": str(r), "conversations": turns}) + "\n")


def make_model(folder: Path, fields: dict, device: str, seed: int = 0) -> float:
    """A random bf16 LlamaForCausalLM of these config fields, saved with its tokenizer; returns billions of params."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**fields, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(SHARPEN)
    model.save_pretrained(folder)
    make_tokenizer(fields["vocab_size"]).save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return params


# ------------------------------------------------------------------------------------------------ efficiency
@dataclass(frozen=True)
class Limit:
    """One of the device's limits (bytes/s of memory, or dense bf16 FLOP/s); value None where unknown."""
    value: Optional[float]
    source: str


@dataclass
class Figure:
    """An achieved rate beside the device's limit for it, judged against a floor (a fraction) on CUDA only."""
    value: float
    limit: Limit
    unit: str
    floor: Optional[float]  # the least fraction that passes; None: reported, not judged
    judged: bool            # a CUDA run; on the CPU every figure is reported, none fails

    @property
    def fraction(self) -> Optional[float]:
        return self.value / self.limit.value if self.limit.value else None

    @property
    def ok(self) -> Optional[bool]:
        if not self.judged or self.floor is None or self.fraction is None:
            return None
        return self.fraction >= self.floor

    def to_dict(self) -> dict:
        problems = [] if self.ok is not False else [
            f"{self.value:.4g} {self.unit} is {self.fraction:.3f} of the device's {self.limit.value:.4g} "
            f"({self.limit.source}), below the floor {self.floor:g}"]
        return {"value": self.value, "limit": self.limit.value, "unit": self.unit, "limit_source": self.limit.source,
                "fraction": self.fraction, "floor": self.floor, "judged": self.judged, "ok": self.ok,
                "problems": problems}


@dataclass(frozen=True)
class DecodeCost:
    """What one target-only decode step of `batch` rows reads and computes: every weight a step multiplies by (not
    the input embedding table, of which it gathers `batch` rows) once, and each row's keys and values of its real
    tokens (`context` of them on average; a static cache's masked columns are not counted, so reading them costs)."""
    bytes: float
    flops: float


def decode_step_cost(params_read: int, elem_bytes: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                     batch: int, context: float) -> DecodeCost:
    kv = 2 * layers * batch * kv_heads * head_dim * context * elem_bytes          # keys and values read
    attention = 4 * layers * batch * heads * head_dim * context                    # q k^T and p v
    return DecodeCost(params_read * elem_bytes + kv, 2 * params_read * batch + attention)


def params_read_per_step(model) -> int:
    """Parameters a decode step reads whole: all but an input embedding table not shared with the output head."""
    total = sum(p.numel() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embed is head else total - embed.numel()


def decode_efficiency(cost: DecodeCost, steps_per_s: float, bandwidth: Limit, peak: Limit, floor: Optional[float],
                      judged: bool) -> dict:
    """Achieved memory and compute rates of decoding beside the device's; the floor applies to the binding one (the
    larger of bytes / bandwidth and FLOPs / peak: the least time a step can take), memory where a limit is unknown."""
    memory = Figure(cost.bytes * steps_per_s, bandwidth, "B/s", None, judged)
    compute = Figure(cost.flops * steps_per_s, peak, "FLOP/s", None, judged)
    memory_bound = not (bandwidth.value and peak.value) or cost.bytes / bandwidth.value >= cost.flops / peak.value
    (memory if memory_bound else compute).floor = floor
    return {"bound": "memory" if memory_bound else "compute", "bytes_per_step": cost.bytes,
            "flops_per_step": cost.flops, "steps_per_s": steps_per_s, "bandwidth": memory.to_dict(),
            "compute": compute.to_dict()}


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write), timed on the device's clock."""
    import torch

    from specdistill.train.throughput import clock_for, seconds_per_op

    n = 2 ** 30 if device == "cuda" else 2 ** 26
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = min(seconds_per_op(lambda: dst.copy_(src), 5, clock_for(torch.device(device))) for _ in range(3))
    return 2 * n / seconds


def device_limits(device: str) -> dict:
    """The device's memory bandwidth and dense bf16 peak: datasheet figures where the device is listed (the copy rate
    measured beside), else the measured copy rate and no compute peak."""
    import torch

    from specdistill.train.throughput import published_peak

    measured = copy_bandwidth(device)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    sheet = next((bw for n, unless, bw in PUBLISHED_BANDWIDTH if n in name and not any(u in name for u in unless)),
                 None)
    bandwidth = (Limit(sheet, f"published ({name}); measured copy {measured / 1e12:.3g} TB/s") if sheet
                 else Limit(measured, "measured (device-to-device copy)"))
    peak = published_peak(name, torch.bfloat16) if device == "cuda" else None
    compute = (Limit(peak.flops_per_s, f"published ({peak.name} bf16 dense)") if peak
               else Limit(None, f"no published dense bf16 peak for {name}"))
    return {"device": name, "bandwidth": asdict(bandwidth), "dense_bf16_peak": asdict(compute),
            "measured_copy_bytes_per_s": measured}


def training_mfu(result: dict, limits: dict, floor: Optional[float], judged: bool) -> dict:
    """Training's achieved FLOP/s (train.py's counted FLOPs per real token x tokens/s) over the device's dense peak:
    the run's own (summary.json device_peak: the datasheet's where known, else measured), else the datasheet's."""
    if result.get("achieved_flops_per_s") is None:
        return {"skipped": "train.py logged no achieved FLOP/s (train/achieved_tflops): trainer.measure_roofline off?"}
    peak = result.get("device_peak") or {}
    if peak.get("peak/flops_per_s"):
        limit = Limit(peak["peak/flops_per_s"], f"train.py's device peak, {peak.get('peak/source')}; measured "
                      f"{peak.get('peak/measured_flops_per_s', math.nan) / 1e12:.4g} TFLOP/s")
    else:
        limit = Limit(**limits["dense_bf16_peak"])
    return Figure(result["achieved_flops_per_s"], limit, "FLOP/s", floor, judged).to_dict()


# ------------------------------------------------------------------------------------------------ compiling
@dataclass(frozen=True)
class CompileCount:
    """Compile counts: torch._dynamo's own (frames compiled, graphs made, hits of its recompile limit past which it
    runs a frame eagerly, CUDA graph captures inductor skipped), and the decoders' (compiles of the given models'
    decode graphs, specdistill.decoding.compile_stats; None when no model was given)."""
    frames: int = 0
    graphs: int = 0
    limit_hits: int = 0
    cudagraph_skips: int = 0
    decoder: Optional[int] = None

    def __add__(self, other: "CompileCount") -> "CompileCount":
        """Sums; an uncounted decoder count (None) adds nothing to a counted one."""
        a, b = asdict(self), asdict(other)
        return CompileCount(**{k: b[k] if a[k] is None else a[k] if b[k] is None else a[k] + b[k] for k in a})

    def __sub__(self, other: "CompileCount") -> "CompileCount":
        a, b = asdict(self), asdict(other)
        return CompileCount(**{k: None if a[k] is None or b[k] is None else a[k] - b[k] for k in a})


def decoder_stats(models: tuple) -> dict:
    """The decoders' compile counters (specdistill.decoding.compile_stats) of these models, by position and class:
    per graph (batch bucket, step width), each meant to compile once."""
    from specdistill.decoding import compile_stats

    return {f"{i}:{type(m).__name__}": compile_stats(m) for i, m in enumerate(m for m in models if m is not None)}


def compile_count(models: tuple = ()) -> CompileCount:
    """The process's compile counts so far, and the decoders' for `models`: the one place compile counts are read."""
    from torch._dynamo.utils import counters

    limit = sum(n for key, n in counters["unimplemented"].items()
                if any(s in key.lower() for s in ("recompile limit", "recompile_limit", "cache_size_limit",
                                                   "cache size limit")))
    stats = decoder_stats(models)
    return CompileCount(counters["frames"]["ok"], counters["stats"]["unique_graphs"], limit,
                        counters["inductor"]["cudagraph_skips"],
                        sum(s.total_compiles for s in stats.values()) if stats else None)


def counted(fn: Callable, models: tuple = ()):
    """(fn(), the CompileCount of the compiles it caused). Garbage is collected first: an earlier call's decoding
    state held only by reference cycles releases its compiled caches, as it does between the calls of a long loop
    (else the decoders may give this call a second cache, and compile its graphs, while the first is still held)."""
    import gc

    gc.collect()
    before = compile_count(models)
    out = fn()
    return out, compile_count(models) - before


@dataclass
class CompileCheck:
    """A compiled path's compiles: its first calls (warm-up: compiling expected) and the calls after them with the
    same shapes, which must compile nothing. Fails when nothing compiled (the path ran eagerly: counted by the
    decoders, else by dynamo's graphs), when dynamo hit its recompile limit (a frame then runs eagerly), when inductor
    skipped a CUDA graph capture (its kernels then launch one by one), or when a call after the warm-up compiled (a
    shape outside the compiled buckets, or a cache length doubled)."""
    warm: CompileCount
    timed: CompileCount
    calls: dict                    # per call: its CompileCount, for the report
    stats: Optional[dict] = None   # the decoders' per-graph counters (decoder_stats), for the report

    def problems(self) -> list[str]:
        total = self.warm + self.timed
        made = total.graphs if total.decoder is None else total.decoder
        out = []
        if made == 0:
            out.append("compiled nothing: no decode graph was compiled, so the compiled path ran eagerly")
        if total.limit_hits:
            out.append(f"dynamo hit its recompile limit {total.limit_hits} time(s): past it a frame runs eagerly")
        if total.cudagraph_skips:
            out.append(f"inductor skipped {total.cudagraph_skips} CUDA graph capture(s): those graphs replay kernel "
                       "by kernel from the host (TORCH_LOGS=perf_hints says why)")
        recompiled = {k: s.recompiles for k, s in (self.stats or {}).items() if s.recompiles}
        if recompiled:
            out.append(f"graphs compiled more than once (the decoders' count, by model): {recompiled}")
        again = max(self.timed.graphs, self.timed.frames, self.timed.decoder or 0)
        if again:
            out.append(f"{again} compile(s) after the warm-up, at shapes already decoded: a shape outside the "
                       "compiled buckets")
        return out

    def to_dict(self) -> dict:
        problems = self.problems()
        stats = None if self.stats is None else {k: s.as_dict() for k, s in self.stats.items()}
        return {"ok": not problems, "warm": asdict(self.warm), "timed": asdict(self.timed),
                "calls": {k: asdict(v) for k, v in self.calls.items()}, "decoder_stats": stats, "problems": problems}


def reset_compiled() -> None:
    """Forget every compiled graph: a stage that compiles starts as a fresh process would (dynamo's recompile limit
    counts per code object, and every model of one class shares its forward's)."""
    import torch

    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ decoding
def prompt_batch(prompt_ids: list[list[int]], pad: int, device: str):
    """All prompts as one left-padded batch: ids and attention mask (B, T)."""
    from specdistill.eval.batches import make_batches

    b = make_batches(prompt_ids, len(prompt_ids), pad, device)[0]
    return b.input_ids, b.attention_mask


def decode_target(target, ids, mask, n: int, cache, **kwargs) -> list[list[int]]:
    from specdistill.decoding import target_generate

    r = target_generate(target, ids, mask, max_new_tokens=n, cache=cache, **kwargs)
    return [r.tokens(i) for i in range(ids.shape[0])]


def decode_spec(target, drafter, ids, mask, n: int, gamma: int, cache) -> list[list[int]]:
    from specdistill.decoding import speculative_generate

    r = speculative_generate(target, drafter, ids, mask, strategy=gamma, max_new_tokens=n, cache=cache)
    return [r.tokens(i) for i in range(ids.shape[0])]


def warm_then_timed(calls: dict[str, Callable], models: tuple) -> tuple[dict, CompileCheck]:
    """Each call twice, all warm-ups first: (the second calls' results, the CompileCheck of the two rounds; models:
    those the calls decode with, whose decoder counts are read)."""
    warm, timed, per_call, results = CompileCount(), CompileCount(), {}, {}
    for name, fn in calls.items():
        _, count = counted(fn, models)
        warm, per_call[f"{name} warm-up"] = warm + count, count
    for name, fn in calls.items():
        results[name], count = counted(fn, models)
        timed, per_call[name] = timed + count, count
    return results, CompileCheck(warm, timed, per_call, decoder_stats(models))


# ------------------------------------------------------------------------------------------------ stages
def run_overrides(run: Path, target: Path, data: Path, sizes: Sizes) -> list[str]:
    """The Hydra overrides every trained stage shares: the stage's target and data, bf16 mixed precision, the sizes."""
    return ["target=local", f"target.path={target}", "target.dtype=bfloat16", f"data.path={data}", "data.format=auto",
            "data.max_rows=null", f"data.max_length={sizes.max_length}", "data.heldout_size=8",
            f"data.cache_dir={run}/data_cache", f"trainer.micro_batch_size={sizes.micro_batch}", "trainer.grad_accum=1",
            "trainer.mixed_precision=bf16", f"draft.draft_vocab_size={sizes.draft_vocab}"]


def run_python(args: list[str], log: Path, device: str, timeout_s: float, what: str) -> None:
    """A Python subprocess from the repository (the user's path), offline, on `device`; its output goes to `log`."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", WANDB_MODE="offline",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")


def train(run: Path, recipe: str, target: Path, data: Path, sizes: Sizes, device: str, extra: list[str],
          timeout_s: float) -> dict:
    """train.py in a subprocess (the user's path), bf16 mixed precision; the logged figures and summary.json's
    device peak."""
    overrides = [f"recipe={recipe}", *run_overrides(run, target, data, sizes), f"trainer.output_dir={run}",
                 "trainer.log_every=1", "trainer.save_every=100000", "trainer.eval_every=0", "trainer.warmup_steps=2",
                 "eval.spec_eval=false", *extra]
    run_python([str(REPO / "train.py"), *overrides], run.parent / f"{run.name}.log", device, timeout_s,
               f"train.py {recipe}")
    log = run.parent / f"{run.name}.log"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "train/loss" in r]
    if not steps:
        raise RuntimeError(f"train.py {recipe} logged no training step; log {log}")
    last = steps[-1]
    losses = [r["train/loss"] for r in steps]
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"{recipe}: non-finite training loss {losses}")
    # steps that logged rates (the FLOP-counted and profiled ones log none), less the first of them, which compiles
    # the loss's kernels and warms the allocator (all of them when it is the only one)
    rated = [r for r in steps if r.get("train/tokens_per_s") is not None]
    timed = rated[1:] or rated

    def mean(key: str, scale: float = 1.0) -> Optional[float]:
        values = [r[key] * scale for r in timed if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    summary = run / "summary.json"
    return {"steps": int(last.get("step", len(steps))), "loss_first": losses[0], "loss_last": losses[-1],
            "tokens_per_s": mean("train/tokens_per_s"), "input_tokens_per_s": mean("train/input_tokens_per_s"),
            "achieved_flops_per_s": mean("train/achieved_tflops", 1e12) or mean("train/achieved_gflops", 1e9),
            "logged_mfu": mean("train/mfu"), "peak_mem_mb": last.get("train/peak_mem_mb"),
            "device_peak": json.loads(summary.read_text()).get("device_peak") if summary.exists() else None,
            "profile": profile_breakdown(run / "profile.json")}


def profile_breakdown(path: Path) -> Optional[dict]:
    """trainer.profile_steps' profile.json, its headline: where the device's time went and MFU's factors."""
    if not path.exists():
        return None
    p = json.loads(path.read_text())
    busy = max(p["busy_s"], 1e-12)
    return {"steps": p["steps"], "wall_s": p["wall_s"], "busy_fraction": p["busy_fraction"], "factors": p["factors"],
            "share_of_busy": {g: s / busy for g, s in p["groups_s"].items()},
            "top": [{k: t[k] for k in ("name", "group", "seconds", "calls")} for t in p["top"][:8]],
            "file": str(path)}


def opd_step_cost(run: Path, target: Path, data: Path, sizes: Sizes, device: str, timeout_s: float,
                  judged: bool, compiled: bool) -> dict:
    """benchmarks/opd_cost.py in a subprocess: one warm-up and two timed optimizer steps of each arm on the same
    micro-batches, the SmolLM2-shaped target in bf16: a Draft-OPD step of an EAGLE-3 head (no warm-up: a random
    head, so rollouts run near their longest) against recipe eagle3_serve's off-policy step, both reading one
    regenerated store. compiled: the rollouts decode on compiled static caches (eval.compile=true, CUDA graphs: the
    path a GPU user sets), else on growing caches. The figure is the on-policy step's seconds per row over the
    off-policy step's; above OPD_STEP_CEILING a CUDA run fails."""
    # the check's own conversations as the prompts (the recipes' default, embedded:sharegpt, is an asset package
    # that a GPU image does not have)
    regen = [f"data.regenerate.prompts={data}", f"data.regenerate.max_prompts={sizes.opd_prompts}",
             f"data.regenerate.max_new_tokens={sizes.opd_new_tokens}"]
    decoding = ["--onpolicy", "eval.compile=true"] if compiled else []
    run_python(["-m", "benchmarks.opd_cost", "--steps", "2", "--offpolicy-recipe", "eagle3_serve", *decoding,
                "--onpolicy", "draft=eagle3", "--onpolicy", "warmup.mode=never",
                "--onpolicy", f"objective.max_new_tokens={sizes.opd_new_tokens}", "--out", str(run),
                *run_overrides(run, target, data, sizes), *regen], run.parent / f"{run.name}.log", device, timeout_s,
               "benchmarks.opd_cost")
    result = json.loads((run / "opd_cost.json").read_text())
    ratio = result["ratio_seconds_per_step_equal_rows"]
    over = judged and ratio > OPD_STEP_CEILING
    arms = {name: {k: arm[k] for k in ("seconds_per_step", "prepare_seconds_per_step", "rows_per_step",
                                      "positions_per_step", "target_forwards_per_step")}
            for name, arm in result["arms"].items()}
    return {"step_ratio_per_row": ratio, "rollout_decoding": "compiled" if compiled else "growing",
            "goal": OPD_STEP_GOAL, "ceiling": OPD_STEP_CEILING, "judged": judged,
            "goal_met": ratio <= OPD_STEP_GOAL, "ratio_per_trained_position": result["ratio_seconds_per_position"],
            "arms": arms, "command": result["command"],
            "problems": [f"an on-policy step costs {ratio:.2f}x an off-policy step per row, above the ceiling "
                         f"{OPD_STEP_CEILING:g}x (goal {OPD_STEP_GOAL:g}x)"] if over else []}


def final_draft(run: Path) -> Path:
    checkpoints = sorted((run / "checkpoints").glob("step-*/draft"))
    if not checkpoints:
        raise RuntimeError(f"no checkpoint with a draft/ under {run / 'checkpoints'}")
    return checkpoints[-1]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specdistill.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


@dataclass
class Models:
    """The 8B-shaped target in bf16, its fp32 copy (the same weights upcast), a tokenizer, the eval settings, and the
    trained head (None without one)."""
    target: object
    target32: object
    tokenizer: object
    cfg: Config      # the checked config (eval settings, draft)
    head: object
    overrides: list  # what composed cfg


def load_models(target_dir: Path, head_dir: Optional[Path], data: Path, sizes: Sizes, device: str,
                dtype: str = "bfloat16") -> Models:
    from specdistill.entry import load_config
    from specdistill.eval.run import load_draft
    from specdistill.models.target import load_causal_lm, load_tokenizer

    base = ["target=local", f"target.path={target_dir}", f"target.dtype={dtype}", "draft=eagle3",
            f"eval.draft_path={head_dir or ''}", f"eval.prompts={data}", f"eval.max_new_tokens={sizes.eval_new_tokens}",
            "eval.batch_size=1", "eval.batch_sizes=[1]", "eval.warmup_prompts=1", "eval.ignore_eos=true",
            "eval.measure_cost=true", "eval.gamma=4", f"eval.device={device}"]
    cfg = load_config(compose(base + [f"eval.num_prompts={sizes.eval_prompts}"]), log=None)
    tokenizer = load_tokenizer(str(target_dir))
    target = load_causal_lm(str(target_dir), dtype).to(device).eval().requires_grad_(False)
    target32 = (target if dtype == "float32" else
                load_causal_lm(str(target_dir), "float32").to(device).eval().requires_grad_(False))
    head = load_draft(cfg, target, tokenizer, log=lambda *_: None).to(device) if head_dir else None
    return Models(target, target32, tokenizer, cfg, head, base)


def prompts_of(m: Models, data: Path, n: int, sizes: Sizes):
    from specdistill.data.prompts import load_prompts

    return load_prompts(str(data), m.tokenizer, num_prompts=n, max_new_tokens=sizes.eval_new_tokens,
                        context=m.target.config.max_position_embeddings)


def evaluate_head(target_dir: Path, head_dir: Path, data: Path, sizes: Sizes, device: str,
                  compile_ok: Callable[[], bool]) -> dict:
    """The evaluator in bf16 (speedup, tau); speculative against target-only decoding of the same prompts judged
    lossless (eval/lossless.py); then both compiled, which must compile once and decode losslessly too."""
    import torch

    from specdistill.decoding import CacheMode
    from specdistill.entry import load_config
    from specdistill.eval.evaluator import evaluate, make_drafter
    from specdistill.eval.lossless import DecodePath, compare_decodings
    from specdistill.tokens import pad_id

    m = load_models(target_dir, head_dir, data, sizes, device)
    ecfg = m.cfg.eval
    ps = prompts_of(m, data, sizes.eval_prompts, sizes)
    r = evaluate(m.target, m.tokenizer, m.head, ps, ecfg, progress=False, log=lambda *_: None)
    out = {"speedup": r.speedup, "mean_accept_len": r.mean_accept_len, "tokens_per_s": r.tokens_per_s,
           "target_only_tokens_per_s": r.target_only_tokens_per_s,
           "evaluator_greedy_mismatches": r.greedy_mismatches,  # prompts; judged below, with the fp32 copy
           "c": None if r.cost is None else r.cost.c, "v": None if r.cost is None else r.cost.v,
           "draft_prefill_ms": None if r.cost is None else r.cost.draft_prefill_ms,
           "predicted_speedup": r.predicted_speedup, "peak_mem_mb": peak_memory_mb(device)}

    drafter, _ = make_drafter(m.head, m.target, ecfg)
    gamma, n = ecfg.gamma, sizes.eval_new_tokens
    ids, mask = prompt_batch(ps.ids, pad_id(m.tokenizer), device)
    eager = CacheMode()
    reference = decode_target(m.target, ids, mask, n, eager)
    spec = decode_spec(m.target, drafter, ids, mask, n, gamma, eager)
    paths = (DecodePath("target-only"),
             DecodePath("speculative verify", chunk=gamma + 1, hidden_states=drafter.needs_hidden_states))
    out["lossless"] = {"speculative_vs_target_only": compare_decodings(
        m.target, m.target32, ids, mask, reference, spec, exact=False, paths=paths, noise_rows=NOISE_ROWS).to_dict()}
    if not compile_ok():
        out["compiled"] = {"skipped": "the time budget (--budget-s) or --compile off"}
        return out

    # Compiled: the evaluator (batch 1, no cost model: its verify-width sweep would compile a graph per width) warms
    # the graphs up on its prompts; decoding each prompt again, alone, must compile nothing.
    reset_compiled()
    ccfg = load_config(compose(m.overrides + [f"eval.num_prompts={sizes.compile_prompts}", "eval.compile=true",
                                              "eval.measure_cost=false"]), log=None).eval
    cps = prompts_of(m, data, sizes.compile_prompts, sizes)
    models = (m.target, m.head)
    t0 = time.perf_counter()
    c, evaluator_count = counted(lambda: evaluate(m.target, m.tokenizer, m.head, cps, ccfg, progress=False,
                                                  log=lambda *_: None), models)
    compiled = CacheMode(compile=True)

    def one_by_one(decode: Callable) -> list[list[int]]:
        return [decode(torch.tensor([p], device=device))[0] for p in cps.ids]

    decoded, check = warm_then_timed({
        "target-only": lambda: one_by_one(lambda x: decode_target(m.target, x, torch.ones_like(x), n, compiled)),
        "speculative": lambda: one_by_one(lambda x: decode_spec(m.target, drafter, x, torch.ones_like(x), n, gamma,
                                                                compiled))}, models)
    check = CompileCheck(evaluator_count + check.warm, check.timed, {"evaluator": evaluator_count, **check.calls},
                         check.stats)
    paths = (DecodePath("compiled target-only", compiled),
             DecodePath("compiled verify", compiled, chunk=gamma + 1, hidden_states=drafter.needs_hidden_states))
    ids, mask = prompt_batch(cps.ids, pad_id(m.tokenizer), device)
    out["compiled"] = {
        "seconds_with_compilation": time.perf_counter() - t0, "speedup": c.speedup, "tokens_per_s": c.tokens_per_s,
        "target_only_tokens_per_s": c.target_only_tokens_per_s, "evaluator_greedy_mismatches": c.greedy_mismatches,
        "compile": check.to_dict(),
        "lossless": {"speculative_vs_target_only": compare_decodings(
            m.target, m.target32, ids, mask, decoded["target-only"], decoded["speculative"], exact=False, paths=paths,
            noise_rows=NOISE_ROWS, rows_per_call=1).to_dict()}}
    return out


def exact_decoding(target_dir: Path, head_dir: Optional[Path], data: Path, sizes: Sizes, device: str,
                   compile_ok: Callable[[], bool]) -> dict:
    """The target (and head) in fp32 with TF32 off: static and compiled caches and speculative decoding must give
    the growing cache's target-only tokens exactly."""
    from specdistill.decoding import CacheMode
    from specdistill.eval.evaluator import make_drafter
    from specdistill.eval.lossless import compare_decodings, tf32_off, tf32_state
    from specdistill.tokens import pad_id

    m = load_models(target_dir, head_dir, data, sizes, device, dtype="float32")  # loading turns TF32 on: off below
    ecfg = m.cfg.eval
    ps = prompts_of(m, data, sizes.eval_prompts, sizes)
    ids, mask = prompt_batch(ps.ids, pad_id(m.tokenizer), device)
    n, gamma = sizes.eval_new_tokens, ecfg.gamma
    drafter = make_drafter(m.head, m.target, ecfg)[0] if m.head is not None else None
    out: dict = {"lossless": {}}
    with tf32_off():
        out["tf32"] = tf32_state()
        reference = decode_target(m.target, ids, mask, n, CacheMode())
        others = {"static": decode_target(m.target, ids, mask, n, CacheMode(static=True))}
        if drafter is not None:
            others["speculative"] = decode_spec(m.target, drafter, ids, mask, n, gamma, CacheMode())
        if compile_ok():
            reset_compiled()
            compiled = CacheMode(compile=True)
            calls = {"compiled": lambda: decode_target(m.target, ids, mask, n, compiled)}
            if drafter is not None:
                calls["compiled_speculative"] = lambda: decode_spec(m.target, drafter, ids, mask, n, gamma, compiled)
            decoded, check = warm_then_timed(calls, (m.target, m.head))
            others.update(decoded)
            out["compile"] = check.to_dict()
        else:
            out["compiled"] = {"skipped": "the time budget (--budget-s) or --compile off"}
        for name, tokens in others.items():
            out["lossless"][f"{name}_vs_growing"] = compare_decodings(m.target, m.target, ids, mask, reference,
                                                                      tokens, exact=True).to_dict()
    if drafter is None:
        out["speculative"] = {"skipped": "no trained head (eagle3 skipped or failed)"}
    out["peak_mem_mb"] = peak_memory_mb(device)
    return out


def regeneration_rate(target_dir: Path, sizes: Sizes, device: str, compile_ok: Callable[[], bool],
                      limits: Optional[dict]) -> dict:
    """Target-only decoding with the aux + final features captured, as regeneration runs it: per batch size and
    cache mode, tokens/s and its share of the device's limits (a warm-up call, then one timed call), and static and
    compiled caches judged lossless against the growing cache's tokens. compile() says whether to run compiled
    caches too (asked per batch size: the time budget)."""
    import torch

    from specdistill.decoding import CacheMode, target_generate
    from specdistill.drafts.eagle3.model import default_aux_layer_ids
    from specdistill.eval.lossless import DecodePath, compare_decodings
    from specdistill.eval.timing import timed
    from specdistill.models.target import load_causal_lm

    target = load_causal_lm(str(target_dir), "bfloat16").to(device).eval().requires_grad_(False)
    target32 = load_causal_lm(str(target_dir), "float32").to(device).eval().requires_grad_(False)
    cfg = target.config
    L = cfg.num_hidden_layers
    layers = list(default_aux_layer_ids(L)) + [L]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = params_read_per_step(target)
    context = sizes.regen_prompt + (sizes.regen_new_tokens - 1) / 2  # mean real tokens a step attends to
    bandwidth = Limit(**limits["bandwidth"]) if limits else Limit(None, "not measured (limits stage failed)")
    peak = Limit(**limits["dense_bf16_peak"]) if limits else Limit(None, "not measured (limits stage failed)")
    out: dict = {"params_read_per_step": params, "lossless": {}, "efficiency": {}}
    warm, after, calls = CompileCount(), CompileCount(), {}
    reset_compiled()
    g = torch.Generator().manual_seed(0)
    for B in sizes.regen_batches:
        ids = torch.randint(len(SPECIALS), cfg.vocab_size, (B, sizes.regen_prompt), generator=g).to(device)
        mask = torch.ones_like(ids)
        modes = {"growing": CacheMode(), "static": CacheMode(static=True)}
        if compile_ok():
            modes["compiled"] = CacheMode(compile=True)
        else:
            out[f"batch{B}_compiled"] = {"skipped": "the time budget (--budget-s) or --compile off"}
        reference = None
        for name, mode in modes.items():
            run = functools.partial(target_generate, target, ids, mask, max_new_tokens=sizes.regen_new_tokens,
                                    capture_layers=layers, cache=mode)
            _, w = counted(run, (target,))  # warm-up (compiles, for the compiled mode)
            (roll, seconds), t = counted(functools.partial(timed, torch.device(device), run), (target,))
            if name == "compiled":
                warm, after, calls = warm + w, after + t, {**calls, f"batch{B} warm-up": w, f"batch{B}": t}
            out[f"batch{B}_{name}_tokens_per_s"] = int(roll.num_new_tokens.sum()) / seconds  # prefill included
            steps_per_s = len(roll.round_seconds) / roll.decode_seconds  # decode steps alone (the prefill apart)
            cost = decode_step_cost(params, target.dtype.itemsize, L, cfg.num_attention_heads,
                                    cfg.num_key_value_heads, head_dim, B, context)
            out["efficiency"][f"batch{B}_{name}"] = decode_efficiency(cost, steps_per_s, bandwidth, peak,
                                                                      DECODE_FLOORS[name], device == "cuda")
            tokens = [roll.tokens(i) for i in range(B)]
            if reference is None:
                reference = tokens
                continue
            paths = (DecodePath("growing", hidden_states=True), DecodePath(name, mode, hidden_states=True))
            out["lossless"][f"batch{B}_{name}_vs_growing"] = compare_decodings(
                target, target32, ids, mask, reference, tokens, exact=False, paths=paths,
                noise_rows=NOISE_ROWS).to_dict()
    if calls:
        out["compile"] = CompileCheck(warm, after, calls, decoder_stats((target,))).to_dict()
    out["peak_mem_mb"] = peak_memory_mb(device)
    return out


# ------------------------------------------------------------------------------------------------ the report
def nodes(tree, path: tuple = ()):
    """Every dict in a JSON-like tree, with its key path."""
    if isinstance(tree, dict):
        yield path, tree
        for k, v in tree.items():
            yield from nodes(v, path + (k,))


def checks(stages: dict) -> dict:
    """What the stages' results say, gathered: `problems` (each failed stage, and each failed check named by its
    stage and path: a lossless verdict, a compile check, an efficiency figure below its floor), `skipped` (what did
    not run, and why), and digests of every lossless verdict, compile check and efficiency figure."""
    out = {"problems": [], "skipped": [], "lossless": {}, "compile": {}, "efficiency": {}}
    for stage, result in stages.items():
        if "error" in result:
            out["problems"].append(f"{stage}: {result['error'][:600]}")
        for path, node in nodes(result):
            where = ".".join((stage,) + path)
            if "skipped" in node:
                out["skipped"].append(f"{where}: {node['skipped']}")
            if isinstance(node.get("problems"), list):
                out["problems"] += [f"{where}: {p}" for p in node["problems"]]
            if len(path) >= 2 and path[-2] == "lossless":
                noise = node.get("noise") or {}
                margins = [d["fp32_margin"] for d in node["divergences"] if d["fp32_margin"] is not None]
                out["lossless"][where] = {k: node[k] for k in ("ok", "precision", "rows", "identical_rows", "rounding",
                                                               "beyond_noise")} | {
                    "noise_bound": noise.get("bound"), "largest_fp32_margin": max(margins, default=None)}
            if path and path[-1] == "compile":
                out["compile"][where] = {"ok": node["ok"], "graphs": node["warm"]["graphs"] + node["timed"]["graphs"],
                                         "graphs_after_warm_up": node["timed"]["graphs"],
                                         "limit_hits": node["warm"]["limit_hits"] + node["timed"]["limit_hits"]}
            if "unit" in node and "fraction" in node and (node["limit"] is not None or node["floor"] is not None):
                out["efficiency"][where] = {k: node[k] for k in ("value", "unit", "limit", "fraction", "floor", "ok")}
    return out


class Report:
    """Stage results, printed as they come and written as JSON with what checks() gathers from them; `ok` is true
    exactly when `problems` is empty."""

    def __init__(self, path: Path, env: dict, budget_s: float, floors: dict):
        self.path, self.t0, self.budget_s = path, time.perf_counter(), budget_s
        self.data = {"env": env, "floors": floors, "stages": {}, "ok": True, "problems": []}

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def stage(self, name: str, fn: Callable[[], dict], device: str) -> Optional[dict]:
        import torch

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        print(f"[gpu_check] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            result, ok = fn(), True
        except Exception as e:  # recorded as a problem; the other stages still run
            result = {"error": f"{type(e).__name__}: {e}"[-4000:], "traceback": traceback.format_exc()[-4000:]}
            ok = False
        if device == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()  # the stage's models go before the next stage loads its own
        result = {"ok": ok, "seconds": round(time.perf_counter() - t0, 1), **result}
        self.data["stages"][name] = result
        self.write()
        result["ok"] = ok and not any(p.startswith(f"{name}.") or p.startswith(f"{name}:")
                                      for p in self.data["problems"])
        self.write()
        shown = {k: v for k, v in result.items() if k not in ("traceback", "lossless", "efficiency")}
        print(f"[gpu_check] {name}: {json.dumps(shown, default=str)[:3000]}", flush=True)
        return result if ok else None

    def skip(self, name: str, why: str) -> None:
        self.data["stages"][name] = {"ok": None, "skipped": why}
        print(f"[gpu_check] {name}: skipped ({why})", flush=True)
        self.write()

    def write(self) -> None:
        self.data.update(checks(self.data["stages"]))
        self.data["ok"] = not self.data["problems"]
        self.data["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (the CPU fallback and its test)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B-shaped target")
    ap.add_argument("--steps", type=int, default=20, help="eagle3 training steps")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="compiled-decoding checks (auto: on CUDA only, while the time budget lasts)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="optional stages are skipped past this")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "specdistill_gpu_check")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json (default $OUT, else --work)")
    ap.add_argument("--skip", default="", help=f"stages not to run, comma-separated, of {','.join(OPTIONAL_STAGES)} "
                    "(said so in the JSON's skipped; evaluate needs eagle3's head)")
    ap.add_argument("--missing", action="store_true", help="print the pip names of missing packages and exit")
    args = ap.parse_args(argv)
    skip = {name for name in args.skip.split(",") if name}
    if skip - set(OPTIONAL_STAGES):
        ap.error(f"--skip {','.join(sorted(skip - set(OPTIONAL_STAGES)))}: no such stage; the stages are "
                 f"{','.join(OPTIONAL_STAGES)}")
    if args.missing:
        print("\n".join(missing_packages()))
        return 0

    missing = missing_packages()
    if importlib.util.find_spec("torch") is None:
        missing.insert(0, "torch")
    if missing:
        print(f"[gpu_check] this machine lacks {', '.join(missing)}: install them (docs/gpu_check.md: wheels carried "
              "in the tree, or pip) and run again. Nothing was checked.", flush=True)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"[gpu_check] torch {torch.__version__} here sees no CUDA device (torch.version.cuda="
              f"{torch.version.cuda}): run on a GPU machine, or --device cpu --tiny for the CPU fallback.", flush=True)
        return 2
    if importlib.util.find_spec("specdistill") is None:
        print(f"[gpu_check] specdistill is not importable: run from {REPO} with PYTHONPATH=. (gpu_check.sh does)")
        return 2

    sizes = tiny_sizes() if args.tiny else real_sizes(args.layers, args.steps)
    compile = args.compile == "on" or (args.compile == "auto" and args.device == "cuda")
    marker = args.work / ".gpu_check"  # a folder this script made, and so may empty
    if args.work.exists() and any(args.work.iterdir()) and not marker.exists():
        print(f"[gpu_check] --work {args.work} holds files this script did not write: pass an empty or new folder")
        return 2
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    marker.touch()
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else args.work)
    out_dir.mkdir(parents=True, exist_ok=True)
    judged = args.device == "cuda"
    floors = {"mfu": MFU_FLOOR, "decode": DECODE_FLOORS, "opd_step_ceiling": OPD_STEP_CEILING, "judged": judged,
              "note": "fractions of the device's limit; a figure below its floor fails on CUDA only"}
    report = Report(out_dir / "gpu_check.json", environment(args.device), args.budget_s, floors)
    report.data["sizes"] = {"tiny": args.tiny, "big_layers": sizes.big["num_hidden_layers"], "steps": sizes.steps}
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    small, big, data = args.work / "smollm2_135m_shape", args.work / "llama8b_shape", args.work / "conversations.jsonl"

    def assets() -> dict:
        write_conversations(data, sizes, min(sizes.small["vocab_size"], sizes.big["vocab_size"]))
        return {"small_b_params": make_model(small, sizes.small, args.device),
                "big_b_params": make_model(big, sizes.big, args.device)}

    if report.stage("assets", assets, args.device) is None:
        return finish(report)
    limits = report.stage("limits", lambda: device_limits(args.device), args.device)
    no_limits = {"bandwidth": asdict(Limit(None, "limits stage failed")),
                 "dense_bf16_peak": asdict(Limit(None, "limits stage failed"))}

    def trained(run: str, recipe: str, target: Path, extra: list[str], floor: Optional[float]) -> dict:
        result = train(args.work / run, recipe, target, data, sizes, args.device, extra, max(report.left_s(), 120.0))
        result["efficiency"] = {"mfu": training_mfu(result, limits or no_limits, floor, judged)}
        return result

    def stage(name: str, fn: Callable[[], dict]) -> Optional[dict]:
        if name in skip:
            report.skip(name, "--skip")
            return None
        return report.stage(name, fn, args.device)

    # steps 3-5 profiled (kept out of the logged rates): where the device's time goes, MFU's factors
    eagle3 = stage("eagle3", lambda: trained("eagle3", "eagle3", big, [f"trainer.max_steps={sizes.steps}",
                                                                       "trainer.profile_steps=3"], MFU_FLOOR))
    # two on-policy steps (the first FLOP-counted, the second timed), mostly decoding: MFU reported, not judged
    stage("draft_opd", lambda: trained("draft_opd", "draft_opd", small,
                                       ["warmup.mode=never", "data.regenerate.enabled=false", "trainer.max_steps=2",
                                        "trainer.export_formats=[]", "objective.max_new_tokens=32"], None))
    head = final_draft(args.work / "eagle3") if eagle3 is not None else None
    if head is None and "evaluate" not in skip:
        report.skip("evaluate", "no trained head (eagle3 skipped or failed)")
    else:
        stage("evaluate", lambda: evaluate_head(big, head, data, sizes, args.device,
                                                lambda: compile and report.left_s() > 150))
    stage("lossless_fp32", lambda: exact_decoding(big, head, data, sizes, args.device,
                                                  lambda: compile and report.left_s() > 120))
    stage("regenerate", lambda: regeneration_rate(big, sizes, args.device, lambda: compile and report.left_s() > 75,
                                                  limits))
    if report.left_s() < 90 and "opd_cost" not in skip:  # last: a run near its budget keeps the stages above
        report.skip("opd_cost", f"{report.left_s():.0f} s of the --budget-s left, under 90")
    else:
        # rollouts on the compiled path on CUDA (in a subprocess: the CPU fallback's traced graphs do not reach it)
        stage("opd_cost", lambda: opd_step_cost(args.work / "opd_cost", small, data, sizes, args.device,
                                                max(report.left_s(), 120.0), judged, args.device == "cuda"))
    return finish(report)


def finish(report: Report) -> int:
    report.write()
    for p in report.data["problems"]:
        print(f"[gpu_check] FAIL {p}", flush=True)
    for s in report.data["skipped"]:
        print(f"[gpu_check] skipped {s}", flush=True)
    print(f"[gpu_check] {'PASS' if report.data['ok'] else 'FAIL'} in {report.data['seconds']} s; "
          f"{report.path}", flush=True)
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
