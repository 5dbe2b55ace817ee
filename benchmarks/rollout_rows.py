"""A Draft-OPD rollout with stopped rows dropped from the batch against the same rollout keeping them.

  python -m benchmarks.rollout_rows draft.path=<a trained EAGLE-3 head> [Hydra overrides of recipe draft_opd]
      [--repeats 2] [--out outputs/rollout_rows]

Builds recipe draft_opd as train.py does (benchmarks/opd_cost.py's Arm; cached stages reused), then rolls out the
first micro-batch's prompts again and again, alternating: decoding.speculative_generate with drop_finished_rows on
(what rollouts run) and off, each from the same rollout seed, `--repeats` times each, one warm-up rollout first.
Per rollout: the decoding's seconds (speculative_generate, the device synchronized), rounds, the rows the target's
verify forwards were fed (row-rounds) and the active ones among them, tokens emitted, each row's output length.
Writes <out>/results.json and results.md with the command. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="timed rollouts per setting, alternating")
    ap.add_argument("--out", default="outputs/rollout_rows")
    own, overrides = ap.parse_known_args(argv)
    if own.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {own.repeats}")
    return own, overrides


def _clock() -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextmanager
def dropping(drop: bool, seen: dict):
    """Rollouts decode with drop_finished_rows=drop while inside; `seen` gets each decode's counts. (Rollouts always
    drop stopped rows; this swaps the decoder the rollout module calls, so that both settings run the same code.)"""
    import specdistill.onpolicy.rollout as rollout

    original = rollout.speculative_generate

    def decode(*args, **kwargs):
        t0 = _clock()
        r = original(*args, **{**kwargs, "drop_finished_rows": drop})
        seen.update(seconds=_clock() - t0, rounds=len(r.rounds), active_row_rounds=int(r.target_forwards.sum()),
                    fed_row_rounds=sum(int(rnd.active.shape[0]) for rnd in r.rounds),
                    tokens=int(r.num_new_tokens.sum()), per_row=r.num_new_tokens.tolist())
        return r

    rollout.speculative_generate = decode
    try:
        yield
    finally:
        rollout.speculative_generate = original


def markdown(runs: list[dict], command: str) -> str:
    lines = [f"`{command}`", "", "| drop_finished_rows | decoding s | rounds | rows fed to verify forwards "
             "| active rows | tokens |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['drop']} | {r['seconds']:.2f} | {r['rounds']} | {r['fed_row_rounds']} | {r['active_row_rounds']} "
              f"| {r['tokens']} |" for r in runs]
    for drop in (True, False):
        s = [r["seconds"] for r in runs if r["drop"] is drop]
        lines.append(f"\ndrop_finished_rows={drop}: {min(s):.2f}-{max(s):.2f} s over {len(s)} rollouts")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    from benchmarks.opd_cost import Arm, start

    own, overrides, command, out = start("benchmarks.rollout_rows", parse_args, argv)

    import torch

    arm = Arm("draft_opd", overrides, out)  # built as opd_cost builds its on-policy arm
    c, seed = arm.c, arm.cfg.trainer.seed
    batch = next(iter(arm.batches.micro_batches(0)))
    obj = c.objective

    def rollout(drop: bool) -> dict:
        seen: dict = {}
        obj.state.generator = torch.Generator(device=batch["input_ids"].device).manual_seed(seed)
        with dropping(drop, seen):
            obj.prepare(batch, c.models)
        obj.end_step()
        return {"drop": drop, **seen}

    rollout(True)  # warm-up: allocations and the first rollout's one-off work
    runs = [rollout(drop) for _ in range(own.repeats) for drop in (True, False)]
    result = {"command": command, "runs": runs}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    md = markdown(runs, command)
    (out / "results.md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
