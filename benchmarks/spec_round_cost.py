"""Seconds per speculative round (decoding.speculative_generate with an EAGLE-3 head), as Draft-OPD's rollouts run it.

A random-weight Llama-3.1-8B-shaped target (--layers of its 32) and a fresh EAGLE-3 head over a --draft-vocab id
subset decode --new-tokens tokens after --prompt random tokens, per batch size and cache mode: one warm-up call, then
one timed call, its capture of the head's aux layers on (record=True, capture_layers: what a rollout asks for).
--drafter oracle: the target's own greedy continuation replayed (drafters.OracleDrafter: every draft accepted, drafting
free), the speculative loop's own cost; --drafter none: target-only decode steps (target_generate; a round is a step).
--tree points at the source tree to import specdistill from (another checkout: the same measurement of other code).
Imports specdistill.decoding / drafts.eagle3, torch and transformers only.

  python -m benchmarks.spec_round_cost --batches 4 64 --modes growing compiled
  python -m benchmarks.spec_round_cost --batches 4 64 --modes compiled-target compiled --count-ops  # the head's graphs
  python -m benchmarks.spec_round_cost --batches 4 64 --modes growing --attention sdpa   # transformers' sdpa
  python -m benchmarks.spec_round_cost --device cpu --tiny --backend eager     # the script's own check
  python -m benchmarks.spec_round_cost --batches 1 --modes compiled --drafter oracle --count-ops

--count-ops: one more call under torch.profiler, counting the operators the host issues per round outside compiled
graphs (top-level aten operators), and of them those that compute (decode_bandwidth.HostOps: on a GPU each is a
kernel launch, whose host cost bounds a small round).
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

from benchmarks.decode_bandwidth import ATTENTIONS, host_ops


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 64])
    ap.add_argument("--modes", nargs="+", default=["growing", "compiled"],
                    choices=("growing", "static", "compiled", "compiled-target"),
                    help="compiled-target: the target's steps compiled, the head's forwards eager")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--attention", default=ATTENTIONS[0], choices=ATTENTIONS,
                    help="the target's attention function (sdpa_grouped: what load_causal_lm gives it)")
    ap.add_argument("--drafter", default="eagle3", choices=("eagle3", "oracle", "none"),
                    help="oracle: the target's greedy output replayed; none: target-only steps")
    ap.add_argument("--count-ops", action="store_true", help="host operators per round outside compiled graphs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.tree.resolve()))
    import torch

    from benchmarks.decode_bandwidth import build_target
    from specdistill.decoding import CacheMode, speculative_generate, target_generate
    from specdistill.decoding.drafters import OracleDrafter
    from specdistill.decoding.kv import BatchKV
    from specdistill.drafts.eagle3 import Eagle3Drafter
    from specdistill.drafts.eagle3.model import build_eagle3

    class EagerHead(Eagle3Drafter):
        """The head's forwards eager whatever the target's cache mode (a growing cache's factory)."""

        def start(self, input_ids, attention_mask, target_hidden=None, new_kv=None):
            super().start(input_ids, attention_mask, target_hidden=target_hidden, new_kv=BatchKV)

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = build_target(args.layers, args.tiny, args.device, dtype, args.attention)
    V = target.config.vocab_size
    torch.manual_seed(1)
    head = build_eagle3(target, torch.randperm(V)[: min(args.draft_vocab, V)].sort().values, None)
    head = head.to(device=args.device, dtype=dtype).eval().requires_grad_(False)
    aux = list(head.config.aux_layer_ids)
    # The chain length's keyword in the imported tree: `strategy` (one loop for chains and trees), else `gamma`.
    key = "strategy" if "strategy" in inspect.signature(speculative_generate).parameters else "gamma"
    points = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(10, V, (batch, args.prompt), generator=g).to(args.device)
        mask = torch.ones_like(ids)
        for name in args.modes:
            mode = {"growing": CacheMode(), "static": CacheMode(static=True),
                    "compiled": CacheMode(compile=True, backend=args.backend),
                    "compiled-target": CacheMode(compile=True, backend=args.backend)}[name]
            drafter_kind = EagerHead if name == "compiled-target" else Eagle3Drafter
            if args.drafter == "oracle":  # the continuation decoded once, before anything is timed
                oracle = OracleDrafter(target, args.new_tokens, cache=mode)
                oracle.prepare(ids, mask)

            def run():
                if args.drafter == "none":
                    return target_generate(target, ids, mask, max_new_tokens=args.new_tokens,  # noqa: B023
                                           cache=mode)  # noqa: B023
                if args.drafter == "oracle":
                    return speculative_generate(target, oracle, ids, mask, **{key: args.gamma},  # noqa: B023
                                                max_new_tokens=args.new_tokens, cache=mode)  # noqa: B023
                return speculative_generate(target, drafter_kind(head), ids, mask, **{key: args.gamma},  # noqa: B023
                                            max_new_tokens=args.new_tokens, record=True, capture_layers=aux,
                                            cache=mode)  # noqa: B023

            run()
            t0 = time.perf_counter()
            roll = run()
            wall = time.perf_counter() - t0
            rounds = len(roll.round_seconds)
            point = {"batch": batch, "mode": name, "rounds": rounds, "round_ms": 1e3 * roll.decode_seconds / rounds,
                     "call_s": wall, "tau": roll.mean_accept_len}
            if args.count_ops:
                ops, roll = host_ops(run)
                point["host_ops_per_round"] = ops.ops / len(roll.round_seconds)
                point["host_kernels_per_round"] = ops.kernels / len(roll.round_seconds)
            points.append(point)
            print(json.dumps(point), flush=True)
    import specdistill

    result = {"command": "python -m benchmarks.spec_round_cost " + " ".join(sys.argv[1:] if argv is None else argv),
              "tree": str(args.tree), "imported": specdistill.__file__, "attention": args.attention,
              "drafter": args.drafter, "points": points}
    print("specdistill from", specdistill.__file__)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
