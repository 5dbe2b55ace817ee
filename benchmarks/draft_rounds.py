"""The EAGLE-3 drafter's own cost per round along a long output, with no target: its propose() and commit() driven by
synthetic target features, as a speculative decode calls them.

Each round proposes a chain of --gamma drafts (greedy), then commits a random number of accepted drafts (each
accepted with probability --accept until the first rejection, as a weak head on a sampled output) with random
verify features, until every row has --new-tokens tokens. The head has the default target's shapes (SmolLM2-135M:
hidden 576, 9 heads of 64, 30 layers; recipe eagle3_serve's 8192-id draft vocabulary) and random weights; what it
costs does not depend on what it drafts. Reported: milliseconds per round, overall and per bucket of output position
(the drafter's cache grows along the output, so a cost that grows with it shows there).
--tree points at the source tree to import specdistill from (another checkout: the same measurement of other code).

  python -m benchmarks.draft_rounds --batch 4 --new-tokens 1024 --out outputs/draft_rounds
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BUCKETS = (0, 128, 256, 512, 1024)  # the last bucket is open: 512 and beyond


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--accept", type=float, default=0.2, help="each draft's acceptance probability")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a tiny head (the script's own check)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 0 <= args.accept < 1:
        ap.error(f"--accept {args.accept}: a probability in [0, 1)")
    sys.path.insert(0, str(args.tree.resolve()))
    import torch

    import specdistill
    from specdistill.decoding.sampling import Sampler
    from specdistill.decoding.tree import TreeShape
    from specdistill.drafts.eagle3 import Eagle3Drafter
    from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    H, heads, kv_heads, hd, layers, V, Vd = ((32, 4, 2, 8, 4, 512, 128) if args.tiny
                                             else (576, 9, 3, 64, 30, 49152, 8192))
    cfg = Eagle3Config(hidden_size=H, intermediate_size=H * 8 // 3, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=hd, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=8192, vocab_size=V, draft_vocab_size=Vd, target_hidden_size=H,
                       aux_layer_ids=[1, layers // 2, layers - 3])
    head = Eagle3Head(cfg).eval().requires_grad_(False)
    B, g = args.batch, torch.Generator().manual_seed(1)

    def features(width):  # the target's hidden_states tuple over `width` positions: every layer the same tensor
        h = torch.randn(B, width, H, generator=g)
        return (h,) * (layers + 1)

    drafter = Eagle3Drafter(head)
    ids = torch.randint(0, V, (B, args.prompt), generator=g)
    drafter.start(ids, torch.ones_like(ids), features(args.prompt))
    made = torch.zeros(B, dtype=torch.long)
    per_bucket: dict[int, list[float]] = {b: [] for b in BUCKETS[:-1]}
    sampler, shape, rounds, t_all = Sampler(), TreeShape.chain(args.gamma), 0, time.perf_counter()
    while int(made.min()) < args.new_tokens:
        at = int(made.min())
        t0 = time.perf_counter()
        drafter.propose(shape, sampler)
        accepted = (torch.rand(B, args.gamma, generator=g) < args.accept).long().cumprod(1).sum(1)  # (B,)
        drafter.commit(accepted, torch.randint(0, V, (B,), generator=g), torch.ones(B, dtype=torch.bool),
                       features(args.gamma + 1))
        ms = 1e3 * (time.perf_counter() - t0)
        per_bucket[max(b for b in BUCKETS[:-1] if b <= at)].append(ms)
        made += accepted + 1
        rounds += 1
    wall = time.perf_counter() - t_all
    labels = [f"{lo}-{hi - 1}" if hi < BUCKETS[-1] else f"{lo}+" for lo, hi in zip(BUCKETS, BUCKETS[1:])]
    result = {"command": "python -m benchmarks.draft_rounds " + " ".join(sys.argv[1:] if argv is None else argv),
              "imported": specdistill.__file__, "batch": B, "prompt": args.prompt, "new_tokens": args.new_tokens,
              "gamma": args.gamma, "accept": args.accept, "threads": args.threads, "rounds": rounds,
              "seconds": wall, "round_ms": 1e3 * wall / rounds,
              "round_ms_by_position": {k: (sum(v) / len(v) if v else None)
                                       for k, v in zip(labels, per_bucket.values())}}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        rows = "\n".join(f"| {k} | {'-' if v is None else f'{v:.2f}'} |"
                         for k, v in result["round_ms_by_position"].items())
        (args.out / "results.md").write_text(
            f"Command: `{result['command']}` (specdistill from {result['imported']})\n\n"
            f"{rounds} rounds, {wall:.2f} s, {result['round_ms']:.2f} ms per round (batch {B}, gamma {args.gamma})\n\n"
            f"| output tokens | ms per round |\n|---|---|\n{rows}\n")
    return result


if __name__ == "__main__":
    main()
