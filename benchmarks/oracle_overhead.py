"""The speculative decoder's own overhead: eval.drafter=oracle (the target's greedy output replayed, so every draft is
accepted and drafting is free) against target-only decoding, through the evaluator, at gamma 4 and batch 1.

The speedup cannot beat bound = (gamma+1) / v(gamma+1), v(k) being the time of a k-token verify forward over a 1-token
forward, both timed on the same target at the same batch; efficiency = speedup / bound is the share the decoder keeps.
The target is SmolLM2-135M-Instruct when its converted folder is cached (specdistill.assets), else a random Llama of
the same shape (the forwards cost the same; the replay does not care what the tokens say). Writes
oracle_overhead.json and oracle_overhead.md (with the command) and the evaluator's results.json / results.md under
--out/eval.

  OMP_NUM_THREADS=2 .venv/bin/python benchmarks/oracle_overhead.py --prompts 6 --max-new-tokens 100
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

DEFAULT_TARGET = "embedded:smollm2-135m-instruct"


def smollm2_shape():
    """A Llama of SmolLM2-135M-Instruct's shape (its config.json), randomly initialised and seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).float().eval().requires_grad_(False)


class IdsTokenizer:
    """What the evaluator asks of a tokenizer when the prompts are token ids and EOS is ignored: decode for the
    outputs file, and no pad or EOS ids (padding then uses id 0)."""
    pad_token_id = eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def cached_target() -> str | None:
    """The converted default target's folder when it is cached (nothing is converted here), else None."""
    from specdistill.cache import CACHE_ROOT

    folder = CACHE_ROOT / "models" / DEFAULT_TARGET.split(":", 1)[1]
    return str(folder) if (folder / "config.json").exists() and (folder / "model.safetensors").exists() else None


def load(target: str, num_prompts: int, max_new_tokens: int):
    """(model, tokenizer, prompts, description): the real target with MT-bench first turns, or the random one of its
    shape with random prompt ids of MT-bench-like lengths."""
    folder = cached_target() if target == "auto" else target
    if folder is None:
        lengths = torch.randint(40, 100, (num_prompts,), generator=torch.Generator().manual_seed(1)).tolist()
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
        return smollm2_shape(), IdsTokenizer(), prompts, "random Llama of SmolLM2-135M's shape (not cached)"
    from specdistill.assets import resolve_model_path
    from specdistill.data.prompts import load_prompts
    from specdistill.models.target import load_causal_lm, load_tokenizer

    path = resolve_model_path(folder)
    model = load_causal_lm(path, "float32").eval().requires_grad_(False)
    tok = load_tokenizer(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    prompts = load_prompts("embedded:mt_bench", tok, num_prompts=num_prompts, max_new_tokens=max_new_tokens)
    return model, tok, prompts, f"{path} (MT-bench first turns)"


def markdown(report: dict) -> str:
    o = report["oracle"]
    g = o["gamma"]
    rows = [("target", report["target"]), ("prompts x new tokens", f"{report['prompts']} x {report['max_new_tokens']}"),
            ("gamma / batch", f"{g} / 1"), ("device, threads, dtype", report["environment"]),
            ("load average before -> after", f"{report['loadavg_before']} -> {report['loadavg_after']}"),
            ("tau", f"{o['tau']:.3f}"), ("greedy mismatches", report["greedy_mismatches"]),
            ("tokens/s speculative / target-only",
             f"{report['tokens_per_s']:.2f} / {report['target_tokens_per_s']:.2f}"),
            ("**speedup** (target-only time / speculative time)", f"{o['speedup']:.3f}"),
            ("decode-only speedup", f"{o['decode_speedup']:.3f}"),
            (f"1-token / {g + 1}-token forward, ms", f"{o['target_step_ms']:.2f} / {o['verify_ms']:.2f}"),
            (f"**v({g + 1})**", f"{o['v']:.3f}"),
            (f"**bound (gamma+1) / v({g + 1})**", f"{o['bound']:.3f}"),
            ("bound at the measured tau", f"{o['bound_at_tau']:.3f}"),
            ("**efficiency = speedup / bound**", f"{o['efficiency']:.3f}"),
            ("decode-only efficiency", f"{o['decode_efficiency']:.3f}"),
            ("wall seconds of the benchmark", f"{report['wall_seconds']:.0f}")]
    return "\n".join(["# Oracle drafter: the speculative decoder's own overhead", "", f"`{report['command']}`", "",
                      "| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="auto", help="auto (the cached default target, else a random one of its "
                   "shape) | an HF folder | embedded:smollm2-135m-instruct (converted if not cached)")
    p.add_argument("--prompts", type=int, default=6)
    # a multiple of gamma+1: no round is cut by the budget, so tau = gamma+1 exactly
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="outputs/oracle_overhead")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    from specdistill.config import EvalConfig
    from specdistill.eval.evaluator import evaluate
    from specdistill.eval.report import write_report

    model, tok, prompts, what = load(args.target, args.prompts, args.max_new_tokens)
    cfg = EvalConfig(drafter="oracle", gamma=args.gamma, batch_size=1, batch_sizes=[1], num_prompts=args.prompts,
                     max_new_tokens=args.max_new_tokens, ignore_eos=True, warmup_prompts=1, measure_cost=True,
                     device="cpu", threads=args.threads)
    load_before = os.getloadavg()[0]
    r = evaluate(model, tok, "oracle", prompts, cfg, progress=True)
    out = Path(args.out)
    write_report(r, out / "eval", plots=False)
    report = {
        "command": " ".join(["OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "unset"), sys.executable]
                            + [shlex.quote(a) for a in sys.argv]),
        "target": what, "prompts": r.num_prompts, "max_new_tokens": args.max_new_tokens,
        "environment": f"{r.env['device']}, {r.env['torch_threads']} threads, {r.env['dtype']}",
        "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0],
        "greedy_mismatches": r.greedy_mismatches, "tokens_per_s": r.tokens_per_s,
        "target_tokens_per_s": r.target_only_tokens_per_s,
        "oracle": r.oracle.__dict__, "wall_seconds": time.perf_counter() - start,
    }
    (out / "oracle_overhead.json").write_text(json.dumps(report, indent=1))
    (out / "oracle_overhead.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
