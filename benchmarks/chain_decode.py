"""Chain decoding speed of two (or more) source trees, in one run: tokens/s of speculative_generate with chains.

A tiny random Llama target (fp32, CPU, one thread) and an EAGLE-3 head built for it (its readout starts as the
target's, so some drafts are accepted) decode --prompts random prompts of --prompt-len tokens, one prompt per call,
greedy, gamma --gamma, --new-tokens each. Every --trees entry is imported in its own subprocess with PYTHONPATH set
to it (so each measures its own specdistill); the trees alternate A/B, B/A, ... for --repeats rounds so that a drift
in the machine's load hits every tree alike. Each subprocess decodes one untimed warm-up pass over the prompts, then
--passes timed passes; a pass's figure is its generated tokens over its decode seconds (Rollout.decode_seconds: the
rounds, prefill excluded). The figure per tree is the median over all its passes; the ratio is each tree's median
over the first tree's. The trees must decode the same tokens (greedy, same weights): the run stops otherwise.
Writes chain_decode.json and chain_decode.md (with the command) in --out.

    python -m benchmarks.chain_decode --trees /tmp/before . --out outputs/chain_decode
    python -m benchmarks.chain_decode --trees . --repeats 1 --passes 1 --prompts 1 --new-tokens 8   # its own check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


# ----------------------------------------------------------------------------------------------- worker (one tree)
def worker(args: argparse.Namespace) -> dict:
    """Runs inside a subprocess whose PYTHONPATH is the tree under test: builds the models and times the passes."""
    import inspect

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import specdistill
    from specdistill.decoding import speculative_generate
    from specdistill.drafts.eagle3 import Eagle3Drafter
    from specdistill.drafts.eagle3.model import build_eagle3

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None, attn_implementation="sdpa")
    target = LlamaForCausalLM(config).float().eval().requires_grad_(False)
    torch.manual_seed(1)
    head = build_eagle3(target, torch.arange(args.vocab), None, output_from_target=True).float().eval()
    head.requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, args.vocab, (1, args.prompt_len), generator=g) for _ in range(args.prompts)]
    # The chain length's keyword: `strategy` where one loop serves chains and trees, `gamma` before.
    key = "strategy" if "strategy" in inspect.signature(speculative_generate).parameters else "gamma"

    def one_pass() -> tuple[int, float, list[list[int]]]:
        tokens, seconds, out = 0, 0.0, []
        for ids in prompts:
            r = speculative_generate(target, Eagle3Drafter(head), ids, torch.ones_like(ids),
                                     max_new_tokens=args.new_tokens, **{key: args.gamma})
            tokens += int(r.num_new_tokens.sum())
            seconds += r.decode_seconds
            out.append(r.tokens(0))
        return tokens, seconds, out

    _, _, decoded = one_pass()  # warm-up
    passes = []
    for _ in range(args.passes):
        tokens, seconds, _ = one_pass()
        passes.append(tokens / seconds)
    digest = hashlib.sha256(json.dumps(decoded).encode()).hexdigest()[:16]
    return {"imported": specdistill.__file__, "tokens_per_s": passes, "tokens_sha": digest,
            "tokens_per_prompt": [len(t) for t in decoded]}


# ----------------------------------------------------------------------------------------------- parent (A/B)
def _commit(tree: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


def _run_tree(tree: Path, argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", *argv], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the worker for {tree} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(result["imported"]).resolve().is_relative_to(tree):
        raise SystemExit(f"the worker for {tree} imported specdistill from {result['imported']}: PYTHONPATH lost")
    return result


def markdown(report: dict) -> str:
    lines = ["# Chain decoding speed by source tree", "",
             f"`{report['command']}`", "",
             f"Tiny Llama target (vocab {report['settings']['vocab']}, hidden {report['settings']['hidden']}, "
             f"{report['settings']['layers']} layers), EAGLE-3 head, fp32 CPU, {report['settings']['threads']} "
             f"thread(s), greedy, gamma {report['settings']['gamma']}, {report['settings']['prompts']} prompt(s) of "
             f"{report['settings']['prompt_len']} tokens, {report['settings']['new_tokens']} new tokens each; "
             f"{report['settings']['repeats']} A/B repeat(s) x {report['settings']['passes']} timed pass(es) per "
             "tree. Decode tokens/s (prefill excluded).", "",
             "| tree | commit | passes | median tokens/s | min | max | ratio to first |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for t in report["trees"]:
        runs = t["tokens_per_s"]
        lines.append(f"| `{t['tree']}` | {t['commit']} | {len(runs)} | {t['median']:.1f} | {min(runs):.1f} | "
                     f"{max(runs):.1f} | {t['ratio']:.3f} |")
    lines += ["", f"Same tokens in every tree: {report['same_tokens']} (sha {report['trees'][0]['tokens_sha']})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", type=Path, nargs="+", default=[Path(__file__).resolve().parent.parent],
                    help="source trees to import specdistill from, each in its own subprocess")
    ap.add_argument("--repeats", type=int, default=5, help="A/B rounds: each tree runs once per round")
    ap.add_argument("--passes", type=int, default=3, help="timed passes over the prompts per subprocess")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("outputs/chain_decode"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return None
    raw = sys.argv[1:] if argv is None else argv
    settings = {k: getattr(args, k) for k in ("repeats", "passes", "prompts", "prompt_len", "new_tokens", "gamma",
                                              "vocab", "hidden", "layers", "threads")}
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]  # the worker's settings
    trees = [t.resolve() for t in args.trees]
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    t0 = time.perf_counter()
    for r in range(args.repeats):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            result = _run_tree(tree, passthrough)
            runs[tree].append(result)
            print(f"repeat {r} {tree}: {[round(x, 1) for x in result['tokens_per_s']]} tokens/s", flush=True)
    shas = {res["tokens_sha"] for rs in runs.values() for res in rs}
    if len(shas) != 1:
        raise SystemExit(f"the trees decoded different tokens ({sorted(shas)}): compare outputs before timing")
    rows = []
    for tree in trees:
        tps = [x for res in runs[tree] for x in res["tokens_per_s"]]
        rows.append({"tree": str(tree), "commit": _commit(tree), "imported": runs[tree][0]["imported"],
                     "tokens_per_s": tps, "median": statistics.median(tps), "tokens_sha": runs[tree][0]["tokens_sha"]})
    for row in rows:
        row["ratio"] = row["median"] / rows[0]["median"]
    report = {"command": "python -m benchmarks.chain_decode " + " ".join(raw), "settings": settings, "trees": rows,
              "same_tokens": True, "wall_seconds": time.perf_counter() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chain_decode.json").write_text(json.dumps(report, indent=1))
    (args.out / "chain_decode.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
