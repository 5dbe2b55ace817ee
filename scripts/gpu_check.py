"""The CUDA path on one GPU, checked in one run (scripts/gpu_check.sh wraps it; docs/gpu_check.md explains it).

Random-weight models of real shapes, built from configs (no model hub): SmolLM2-135M, and a Llama-3.1-8B-shaped
target with a few layers. Stages, each timed and recorded, a failure recorded without stopping the others:
  1. eagle3      recipe=eagle3 on the 8B-shaped target, bf16 mixed precision, 20 steps (train.py, a subprocess)
  2. draft_opd   recipe=draft_opd, one on-policy step of an EAGLE-3 head on the SmolLM2-shaped target, bf16
  3. evaluate    the evaluator in bf16 on the 8B-shaped target with the head of stage 1: speedup, tau, and greedy
                 output token-identical to target-only decoding; then with eval.compile=true (static caches, CUDA
                 graphs), which must give the same tokens
  4. regenerate  target-only decoding with feature capture, as regeneration runs it, at batch 16 and 128: tokens/s
                 on growing, static and compiled caches
Writes gpu_check.json (every figure, peak memory per stage) to --out, else $OUT, else the work folder.

  python scripts/gpu_check.py                       # one GPU, under 8 minutes on an H200
  python scripts/gpu_check.py --device cpu --tiny   # the same stages at toy sizes on the CPU, in about a minute
Exit status: 0 when every stage that ran passed, 1 when one failed, 2 when the machine lacks what the check needs.
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What the checked paths import; torch is checked apart (its CUDA build matters).
REQUIRED = {"transformers": "transformers", "accelerate": "accelerate", "datasets": "datasets", "hydra": "hydra-core",
            "omegaconf": "omegaconf", "safetensors": "safetensors", "tokenizers": "tokenizers",
            "huggingface_hub": "huggingface_hub", "tqdm": "tqdm"}  # module -> pip name
SHARPEN = 8.0  # lm_head scale: peaked distributions, so fewer greedy argmaxes sit at a near-tie
# In bf16 two decodings of the same tokens can differ where the target's top-2 logits are within rounding: a 1-token
# and a (K+1)-token forward (or a static and a growing cache, eager and compiled kernels) sum in different orders.
# A divergence whose top-2 margin is under NEAR_TIE x the logits' scale is such a near-tie; any other is a failure.
NEAR_TIE = 2 ** -6
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
    return Sizes(small, big, rows=40, answer_words=(20, 40), max_length=96, micro_batch=2, steps=2, draft_vocab=256,
                 eval_prompts=2, eval_new_tokens=12, compile_prompts=1, regen_batches=(2, 4), regen_prompt=8,
                 regen_new_tokens=8)


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


# ------------------------------------------------------------------------------------------------ near-ties
def logit_scale(target, device: str) -> float:
    """Mean |top logit| over a random 64-token context: the scale near-ties are measured against."""
    import torch

    ids = torch.randint(len(SPECIALS), target.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return target(ids.to(device)).logits.float().max(-1).values.abs().mean().item()


def beyond_near_ties(margins: list[float], scale: float) -> int:
    return sum(m > NEAR_TIE * scale for m in margins)


def divergence_margins(target, ids, a, b) -> list[float]:
    """Rows where token sequences a and b (B, N) differ: the target's top-2 logit margin (a fresh forward, no cache)
    after the prompt ids (B, T, all real) and a's tokens before the first difference."""
    import torch

    margins = []
    for row in (a != b).any(1).nonzero().flatten().tolist():
        j = int((a[row] != b[row]).nonzero()[0])
        context = torch.cat([ids[row], a[row, :j]])[None]
        with torch.no_grad():
            top2 = target(context).logits[0, -1].float().topk(2).values
        margins.append((top2[0] - top2[1]).item())
    return margins


# ------------------------------------------------------------------------------------------------ stages
def train(run: Path, recipe: str, target: Path, data: Path, sizes: Sizes, device: str, extra: list[str],
          timeout_s: float) -> dict:
    """train.py in a subprocess (the user's path), bf16 mixed precision; the last logged metrics."""
    overrides = [f"recipe={recipe}", "target=local", f"target.path={target}", "target.dtype=bfloat16",
                 f"data.path={data}", "data.format=auto", "data.max_rows=null", f"data.max_length={sizes.max_length}",
                 "data.heldout_size=8", f"data.cache_dir={run}/data_cache", f"trainer.output_dir={run}",
                 f"trainer.micro_batch_size={sizes.micro_batch}", "trainer.grad_accum=1",
                 "trainer.mixed_precision=bf16", "trainer.log_every=1", "trainer.save_every=100000",
                 "trainer.eval_every=0", "trainer.warmup_steps=2", "eval.spec_eval=false",
                 f"draft.draft_vocab_size={sizes.draft_vocab}", *extra]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", WANDB_MODE="offline",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    log = run.parent / f"{run.name}.log"
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"train.py {recipe} exited {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "train/loss" in r]
    if not steps:
        raise RuntimeError(f"train.py {recipe} logged no training step; log {log}")
    last = steps[-1]
    losses = [r["train/loss"] for r in steps]
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"{recipe}: non-finite training loss {losses}")
    timed = steps[1:] or steps  # the first logged step includes compilation of kernels and the FLOP count
    return {"steps": int(last.get("step", len(steps))), "loss_first": losses[0], "loss_last": losses[-1],
            "tokens_per_s": sum(r["train/tokens_per_s"] for r in timed) / len(timed),
            "input_tokens_per_s": sum(r.get("train/input_tokens_per_s", math.nan) for r in timed) / len(timed),
            "roofline_fraction": last.get("train/roofline_fraction"), "peak_mem_mb": last.get("train/peak_mem_mb")}


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


def evaluate_head(target_dir: Path, head_dir: Path, data: Path, sizes: Sizes, device: str, compile: bool) -> dict:
    """The evaluator in bf16 (target loaded in bf16), greedy; with compile, also on compiled static caches."""

    from omegaconf import OmegaConf

    from specdistill.data.prompts import load_prompts
    from specdistill.eval.evaluator import evaluate
    from specdistill.eval.run import load_draft
    from specdistill.models.target import load_causal_lm, load_tokenizer

    base = ["target=local", f"target.path={target_dir}", "target.dtype=bfloat16", "draft=eagle3",
            f"eval.draft_path={head_dir}", f"eval.prompts={data}", f"eval.max_new_tokens={sizes.eval_new_tokens}",
            "eval.batch_size=1", "eval.batch_sizes=[1]", "eval.warmup_prompts=1", "eval.ignore_eos=true",
            "eval.measure_cost=true", "eval.gamma=4", f"eval.device={device}"]
    cfg = compose(base + [f"eval.num_prompts={sizes.eval_prompts}"])
    tokenizer = load_tokenizer(str(target_dir))
    target = load_causal_lm(str(target_dir), "bfloat16").to(device).eval().requires_grad_(False)
    head = load_draft(cfg, target, tokenizer, log=lambda *_: None).to(device)
    context = target.config.max_position_embeddings

    def prompts(n: int):
        return load_prompts(str(data), tokenizer, num_prompts=n, max_new_tokens=sizes.eval_new_tokens, context=context)

    scale = logit_scale(target, device)
    r = evaluate(target, tokenizer, head, prompts(sizes.eval_prompts), OmegaConf.to_object(cfg.eval), progress=False,
                 log=lambda *_: None)
    out = {"speedup": r.speedup, "mean_accept_len": r.mean_accept_len, "tokens_per_s": r.tokens_per_s,
           "target_only_tokens_per_s": r.target_only_tokens_per_s, "greedy_mismatches": r.greedy_mismatches,
           "mismatches_beyond_near_ties": beyond_near_ties([m["top2_logit_margin"] for m in r.mismatches], scale),
           "logit_scale": scale,
           "c": None if r.cost is None else r.cost.c, "v": None if r.cost is None else r.cost.v,
           "draft_prefill_ms": None if r.cost is None else r.cost.draft_prefill_ms,
           "predicted_speedup": r.predicted_speedup, "peak_mem_mb": peak_memory_mb(device)}
    if r.greedy_mismatches:
        out["mismatches"] = r.mismatches[:5]
    if compile:
        ccfg = compose(base + [f"eval.num_prompts={sizes.compile_prompts}", "eval.compile=true"])
        t0 = time.perf_counter()
        c = evaluate(target, tokenizer, head, prompts(sizes.compile_prompts), OmegaConf.to_object(ccfg.eval),
                     progress=False, log=lambda *_: None)
        eager = [s["text"] for s in r.samples][: len(c.samples)]
        out["compiled"] = {"seconds_with_compilation": time.perf_counter() - t0, "speedup": c.speedup,
                           "tokens_per_s": c.tokens_per_s, "target_only_tokens_per_s": c.target_only_tokens_per_s,
                           "greedy_mismatches": c.greedy_mismatches,
                           "mismatches_beyond_near_ties": beyond_near_ties(
                               [m["top2_logit_margin"] for m in c.mismatches], scale),
                           "prompts_with_eager_tokens": sum(x == s["text"] for x, s in zip(eager, c.samples)),
                           "prompts": len(eager)}
    return out


def regeneration_rate(target_dir: Path, sizes: Sizes, device: str, compile) -> dict:
    """Target-only decoding with the aux + final features captured, as regeneration runs it: tokens/s per batch size
    and cache mode (a warm-up call first, then one timed call). compile() says whether to time compiled caches too
    (asked per batch size: the time budget)."""
    import torch

    from specdistill.decoding import CacheMode, target_generate
    from specdistill.eval.timing import timed
    from specdistill.drafts.eagle3.model import default_aux_layer_ids
    from specdistill.models.target import load_causal_lm

    target = load_causal_lm(str(target_dir), "bfloat16").to(device).eval().requires_grad_(False)
    L = target.config.num_hidden_layers
    layers = list(default_aux_layer_ids(L)) + [L]
    scale = logit_scale(target, device)
    out, reference = {"logit_scale": scale}, {}
    g = torch.Generator().manual_seed(0)
    for B in sizes.regen_batches:
        ids = torch.randint(len(SPECIALS), target.config.vocab_size, (B, sizes.regen_prompt), generator=g).to(device)
        mask = torch.ones_like(ids)
        modes = {"growing": CacheMode(), "static": CacheMode(static=True)}
        if compile():
            modes["compiled"] = CacheMode(compile=True)
        for name, mode in modes.items():
            run = functools.partial(target_generate, target, ids, mask, max_new_tokens=sizes.regen_new_tokens,
                                    capture_layers=layers, cache=mode)
            run()  # warm-up (compiles, for the compiled mode)
            roll, seconds = timed(torch.device(device), run)
            new = int(roll.num_new_tokens.sum())
            out[f"batch{B}_{name}_tokens_per_s"] = new / seconds
            margins = divergence_margins(target, ids, reference.setdefault(B, roll.sequences), roll.sequences)
            if name != "growing":  # rows that part from the growing cache's tokens, and how many beyond near-ties
                out[f"batch{B}_{name}_rows_differing"] = len(margins)
                out[f"batch{B}_{name}_beyond_near_ties"] = beyond_near_ties(margins, scale)
    out["peak_mem_mb"] = peak_memory_mb(device)
    return out


# ------------------------------------------------------------------------------------------------ the run
class Report:
    """Stage results, printed as they come and written as JSON."""

    def __init__(self, path: Path, env: dict, budget_s: float):
        self.path, self.t0, self.budget_s = path, time.perf_counter(), budget_s
        self.data = {"env": env, "stages": {}, "ok": True}

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def stage(self, name: str, fn, device: str) -> dict | None:
        import torch

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        print(f"[gpu_check] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            result, ok = fn(), True
        except Exception as e:  # recorded; the other stages still run
            result = {"error": f"{type(e).__name__}: {e}"[-4000:], "traceback": traceback.format_exc()[-4000:]}
            ok = False
        result = {"ok": ok, "seconds": round(time.perf_counter() - t0, 1), **result}
        self.data["stages"][name] = result
        self.data["ok"] &= ok
        shown = {k: v for k, v in result.items() if k != "traceback"}
        print(f"[gpu_check] {name}: {json.dumps(shown, default=str)}", flush=True)
        self.write()
        return result if ok else None

    def skip(self, name: str, why: str) -> None:
        self.data["stages"][name] = {"ok": None, "skipped": why}
        print(f"[gpu_check] {name}: skipped ({why})", flush=True)

    def write(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def checks(stages: dict) -> list[str]:
    """The pass conditions beyond 'it ran': greedy identity, same tokens on every cache mode."""
    problems = []
    ev = stages.get("evaluate") or {}
    if ev.get("mismatches_beyond_near_ties"):
        problems.append(f"evaluate: {ev['mismatches_beyond_near_ties']} greedy mismatches against target-only decoding "
                        "beyond bf16 near-ties")
    if (ev.get("compiled") or {}).get("mismatches_beyond_near_ties"):
        problems.append("evaluate: compiled speculative decoding parts from compiled target-only decoding beyond "
                        "bf16 near-ties")
    regen = stages.get("regenerate") or {}
    problems += [f"regenerate: {k} = {v}" for k, v in regen.items() if k.endswith("beyond_near_ties") and v]
    return problems


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
    ap.add_argument("--missing", action="store_true", help="print the pip names of missing packages and exit")
    args = ap.parse_args(argv)
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
    report = Report(out_dir / "gpu_check.json", environment(args.device), args.budget_s)
    report.data["sizes"] = {"tiny": args.tiny, "big_layers": sizes.big["num_hidden_layers"], "steps": sizes.steps}
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    small, big, data = args.work / "smollm2_135m_shape", args.work / "llama8b_shape", args.work / "conversations.jsonl"

    def assets() -> dict:
        write_conversations(data, sizes, min(sizes.small["vocab_size"], sizes.big["vocab_size"]))
        return {"small_b_params": make_model(small, sizes.small, args.device),
                "big_b_params": make_model(big, sizes.big, args.device)}

    if report.stage("assets", assets, args.device) is None:
        report.write()
        return 1
    timeout = max(report.left_s(), 120.0)
    eagle3 = report.stage("eagle3", lambda: train(args.work / "eagle3", "eagle3", big, data, sizes, args.device,
                                                  [f"trainer.max_steps={sizes.steps}"], timeout), args.device)
    report.stage("draft_opd", lambda: train(args.work / "draft_opd", "draft_opd", small, data, sizes, args.device,
                                            ["warmup.mode=never", "data.regenerate.enabled=false",
                                             "trainer.max_steps=1", "trainer.export_formats=[]",
                                             "objective.max_new_tokens=32"], max(report.left_s(), 120.0)),
                 args.device)
    if eagle3 is None:
        report.skip("evaluate", "no trained head (eagle3 failed)")
    else:
        head = final_draft(args.work / "eagle3")
        report.stage("evaluate", lambda: evaluate_head(big, head, data, sizes, args.device,
                                                       compile and report.left_s() > 150), args.device)
    report.stage("regenerate", lambda: regeneration_rate(big, sizes, args.device,
                                                         lambda: compile and report.left_s() > 75), args.device)

    problems = checks(report.data["stages"])
    report.data["problems"] = problems
    report.data["ok"] = report.data["ok"] and not problems
    report.write()
    for p in problems:
        print(f"[gpu_check] FAIL {p}", flush=True)
    print(f"[gpu_check] {'PASS' if report.data['ok'] else 'FAIL'} in {report.data['seconds']} s; "
          f"{report.path}", flush=True)
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
