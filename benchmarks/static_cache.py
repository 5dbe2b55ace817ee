"""Static vs growing KV caches: target-only decoding tokens/s on a small random Llama (CPU, fp32), batch 1 and 16.

    python -m benchmarks.static_cache --out outputs/static_cache

A static cache (CacheMode(static=True)) preallocates its columns; eager forwards on it attend to the used columns
only, as a growing cache's do, so the ratio static / growing should be >= 1 up to timing noise. Batch 16 runs twice:
dense (every prompt the same length: no row needs a mask, SDPA may skip it) and ragged (left-padded prompts).
Each setting times `--repeats` calls per cache mode, interleaved, after one warm-up call each. The figure is the
fastest call (timeit's rule: on a shared machine the other processes only ever add time); the medians are kept
too, and the same ratio from this process's CPU time (time.process_time, which another process's load does not
inflate: on a busy machine it is the steadier of the two).
Writes static_cache.json and static_cache.md (with the command) in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def small_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, intermediate_size=512, max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, attn_implementation="sdpa")
    return LlamaForCausalLM(config).float().eval()


def prompts(batch: int, length: int, ragged: bool, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (batch, length) ids and mask; ragged rows have lengths spread over [length/4, length]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    lengths = torch.full((batch,), length)
    if ragged:
        lengths = torch.linspace(length // 4, length, batch).round().long()
    mask = (torch.arange(length) >= length - lengths[:, None]).long()
    return ids * mask, mask


def time_modes(model, ids, mask, new_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    """tokens/s of the fastest and of the median call per cache mode, calls interleaved; checks that the modes'
    tokens agree."""
    from specdistill.decoding import CacheMode, target_generate

    modes = {"growing": CacheMode(), "static": CacheMode(static=True)}
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    cpu: dict[str, list[float]] = {name: [] for name in modes}
    outputs = {name: target_generate(model, ids, mask, max_new_tokens=new_tokens, cache=mode).sequences
               for name, mode in modes.items()}  # warm-up
    if not torch.equal(outputs["growing"], outputs["static"]):
        raise SystemExit("static and growing caches decoded different tokens: fix that before timing")
    for _ in range(repeats):
        for name, mode in modes.items():
            t0, c0 = time.perf_counter(), time.process_time()
            target_generate(model, ids, mask, max_new_tokens=new_tokens, cache=mode)
            seconds[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    tokens = ids.shape[0] * new_tokens
    return {name: {"best": tokens / min(s), "median": tokens / statistics.median(s),
                   "cpu": tokens / statistics.median(cpu[name])} for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("outputs/static_cache"))
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (the longest row)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = small_llama()
    vocab = model.config.vocab_size
    rows = []
    for batch, ragged in [(1, False), (16, False), (16, True)]:
        ids, mask = prompts(batch, args.prompt, ragged, vocab)
        with torch.no_grad():
            rate = time_modes(model, ids, mask, args.new_tokens, args.repeats)
        g, st = rate["growing"], rate["static"]
        rows.append({"batch": batch, "prompts": "ragged" if ragged else "dense",
                     "growing_tokens_per_s": g["best"], "static_tokens_per_s": st["best"],
                     "static_over_growing": st["best"] / g["best"],
                     "growing_tokens_per_s_median": g["median"], "static_tokens_per_s_median": st["median"],
                     "static_over_growing_median": st["median"] / g["median"],
                     "static_over_growing_cpu_time": st["cpu"] / g["cpu"]})
        r = rows[-1]
        print(f"batch {batch:>2} {r['prompts']:>6}: growing {g['best']:8.1f} tok/s, static {st['best']:8.1f} tok/s, "
              f"static/growing {r['static_over_growing']:.3f} (medians {r['static_over_growing_median']:.3f}, "
              f"CPU time {r['static_over_growing_cpu_time']:.3f})",
              flush=True)
    command = "python -m benchmarks.static_cache " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": command.strip(), "model": "random Llama, 4 layers, hidden 256, vocab 2048, fp32, sdpa",
              "device": "cpu", "threads": args.threads, "torch": torch.__version__,
              "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "static_cache.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Static vs growing KV caches (target-only decoding, {result['model']}, CPU)", "",
             f"`{result['command']}` (torch {torch.__version__}, {args.threads} thread(s), fastest of "
             f"{args.repeats} calls per mode, interleaved; then the ratio of medians, and of median CPU times)", "",
             "| batch | prompts | growing tok/s | static tok/s | static / growing | medians | CPU time |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['prompts']} | {r['growing_tokens_per_s']:.1f} | {r['static_tokens_per_s']:.1f} | "
              f"{r['static_over_growing']:.3f} | {r['static_over_growing_median']:.3f} | "
              f"{r['static_over_growing_cpu_time']:.3f} |" for r in rows]
    (args.out / "static_cache.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
