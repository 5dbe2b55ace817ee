"""Where a training step's time goes: torch.profiler over a few optimizer steps of any recipe (cached stages reused).

  python -m benchmarks.profile_step recipe=eagle3_serve --steps 3 --out outputs/profile_eagle3_serve

Hydra overrides as for train.py; --steps/--out are this script's own. Writes profile.json and profile.md (self CPU
time by op, grouped: matmul, attention/softmax, elementwise, indexing/copies, optimizer) plus the counted FLOPs per
real token and this CPU's dense fp32 peak, so the step's MFU is read next to its breakdown. Run it on an idle machine.
"""
import argparse
import json
import shlex
import sys
import time
from pathlib import Path

GROUPS = {  # op name prefix -> group (first match wins)
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"),
    "softmax / log_softmax": ("aten::_softmax", "aten::_log_softmax", "aten::softmax", "aten::log_softmax"),
    "optimizer": ("Optimizer.step", "aten::_foreach", "aten::addcdiv", "aten::lerp"),
    "indexing / gather / copies": ("aten::index", "aten::gather", "aten::scatter", "aten::masked", "aten::copy_",
                                   "aten::to", "aten::_to_copy", "aten::cat", "aten::clone", "aten::roll",
                                   "aten::nonzero", "aten::repeat_interleave", "aten::where"),
}


def group_of(name: str) -> str:
    for g, prefixes in GROUPS.items():
        if name.startswith(prefixes):
            return g
    return "elementwise / other"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="outputs/profile")
    own, overrides = ap.parse_known_args(argv)
    command = "python -m benchmarks.profile_step " + " ".join(shlex.quote(a) for a in argv)

    import torch
    from hydra import compose, initialize_config_dir

    from specdistill.config import CONF_DIR, register_configs
    from specdistill.data.loader import StepBatches
    from specdistill.pipeline.run import build_components
    from specdistill.threads import configure_threads
    from specdistill.train.throughput import count_flops, device_peak, step_flops

    register_configs()
    out = Path(own.out)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides + [f"trainer.output_dir={out / 'run'}",
                                                       "trainer.measure_roofline=false"])
    configure_threads(cfg.trainer.threads, "trainer.threads")
    c = build_components(cfg)
    t = cfg.trainer
    batches = StepBatches(c.data.train, t.micro_batch_size, t.grad_accum, c.models.tokenizer.pad_token_id, t.seed)
    obj, models, opt = c.objective, c.models, c.optimizer

    def one_step(step: int) -> tuple[int, int]:
        """(loss tokens, real input tokens) of the step."""
        n, n_input = 0, 0
        for b in batches.micro_batches(step):
            n_input += int(b["attention_mask"].sum())
            p = obj.prepare(b, models)
            n += int(obj.num_tokens(p))
            out_ = obj.loss(p, models)
            (out_.loss * (1 if out_.weight is None else out_.weight)).sum().div(max(n, 1)).backward()
        obj.end_step()  # deferred state updates (Draft-OPD: the replay buffer)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return n, n_input

    one_step(0)  # warm-up
    flops = count_flops(lambda: one_step(1))
    per_token = step_flops(flops.flops, batches.micro_batches(1)).flops_per_token  # per real token, padding excluded
    peak = device_peak("cpu")
    from torch.profiler import ProfilerActivity, profile

    t0, tokens, input_tokens = time.perf_counter(), 0, 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(2, 2 + own.steps):
            n, n_input = one_step(s)
            tokens, input_tokens = tokens + n, input_tokens + n_input
    wall = time.perf_counter() - t0  # profiled wall time (the profiler adds a little)
    by_group: dict[str, float] = {}
    rows = []
    for e in prof.key_averages():
        self_s = e.self_cpu_time_total / 1e6
        by_group[group_of(e.key)] = by_group.get(group_of(e.key), 0.0) + self_s
        rows.append((e.key, self_s, e.count))
    rows.sort(key=lambda r: -r[1])
    total = sum(by_group.values()) or 1.0
    tok_s, input_tok_s = tokens / wall, input_tokens / wall
    achieved = input_tok_s * per_token
    result = {"command": command, "steps": own.steps, "loss_tokens": tokens, "wall_s": wall, "tokens_per_s": tok_s,
              "input_tokens_per_s": input_tok_s, "flops_per_token": per_token, "peak": peak.as_dict(),
              "achieved_gflops": achieved / 1e9, "mfu": achieved / peak.flops_per_s, "threads": torch.get_num_threads(),
              "groups_s": dict(sorted(by_group.items(), key=lambda kv: -kv[1])),
              "top_ops": [{"op": k, "self_s": s, "calls": n} for k, s, n in rows[:15]]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    md = [f"`{command}`", "", f"{own.steps} steps, {tokens} loss tokens, {wall:.1f} s -> {tok_s:.1f} loss tokens/s; "
          f"{input_tok_s:.1f} real tokens/s x {per_token / 1e6:.1f} MFLOP per real token (torch FlopCounterMode) = "
          f"{result['achieved_gflops']:.1f} GFLOPS of {peak.flops_per_s / 1e9:.1f} GFLOPS dense peak "
          f"({peak.source}: {peak.size}^3 {peak.dtype} products, {torch.get_num_threads()} threads) = "
          f"MFU {100 * result['mfu']:.0f}%", "",
          "| where the time goes | self CPU s | share |", "|---|---|---|"]
    md += [f"| {g} | {s:.2f} | {100 * s / total:.0f}% |" for g, s in result["groups_s"].items()]
    md += ["", "| top ops | self CPU s | calls |", "|---|---|---|"]
    md += [f"| `{r['op']}` | {r['self_s']:.2f} | {r['calls']} |" for r in result["top_ops"]]
    (out / "profile.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
