"""Learning curves: real speculative tau of every checkpoint of a run, against training tokens and wall minutes.

Each checkpoint's draft decodes the same prompts with the shared engine (decoding.speculative_generate, greedy by
default); tau = emitted tokens / target forwards. Only tau is measured here (no timing, so it may run beside other
work); the speedup of the final draft belongs to scripts/evaluate.py on an idle machine.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch


@dataclass
class CurvePoint:
    step: int
    tokens_seen: int  # loss tokens trained on (trainer_state.json)
    wall_minutes: float  # training wall time when the checkpoint was written (eval / checkpoint time included)
    tau: float  # tokens per target forward, bonus included
    accept_rate_per_pos: list[float]  # P(draft k accepted)
    prompts: int
    new_tokens: int
    # per prompt, in prompt order: {prompt, new_tokens, target_forwards, reached_per_pos, accepted_per_pos} (the
    # evaluator's sample fields), so two curves' points pair up in scripts/compare_evals.py (CURVE_DIR@STEP)
    samples: list[dict] = field(default_factory=list)


@dataclass
class TauResult:
    tau: float  # emitted tokens / target forwards over all prompts
    accept_rate_per_pos: list[float]  # (gamma,) P(draft k accepted)
    new_tokens: int
    samples: list[dict]  # per prompt (CurvePoint.samples)


def checkpoint_wall_minutes(run_dir: Path, ckpt: Path, state: dict) -> float:
    """Wall minutes of training at a checkpoint: the loop's own clock when it recorded one, else the checkpoint's
    write time minus the run's start (config.yaml is written when fit starts, after data preparation)."""
    if "wall_s" in state:
        return state["wall_s"] / 60
    start = (run_dir / "config.yaml").stat().st_mtime
    return (ckpt.stat().st_mtime - start) / 60


def tau_of(target_model, draft, prompt_ids: list[list[int]], *, gamma: int, max_new_tokens: int, eos,
           temperature: float = 0.0, seed: int = 0) -> TauResult:
    """tau, acceptance per position and per-prompt counts of `draft` on the prompts, one prompt at a time."""
    from specdistill.eval.evaluator import make_drafter
    from specdistill.config import EvalConfig
    from specdistill.decoding import speculative_generate

    drafter, _ = make_drafter(draft, target_model, EvalConfig(gamma=gamma))
    device = next(target_model.parameters()).device
    proposed = torch.zeros(gamma)
    accepted = torch.zeros(gamma)
    samples = []
    for i, p in enumerate(prompt_ids):
        ids = torch.tensor([p], device=device)
        gen = torch.Generator(device=device).manual_seed(seed + i) if temperature > 0 else None
        r = speculative_generate(target_model, drafter, ids, torch.ones_like(ids), strategy=gamma,
                                 max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos,
                                 generator=gen)
        reached, hit = r.position_proposed[:gamma].cpu().float(), r.position_accepted[:gamma].cpu().float()
        proposed += reached
        accepted += hit
        samples.append({"prompt": i, "new_tokens": int(r.num_new_tokens.sum()),
                        "target_forwards": int(r.target_forwards.sum()),
                        "reached_per_pos": [int(x) for x in reached], "accepted_per_pos": [int(x) for x in hit]})
    tokens = sum(x["new_tokens"] for x in samples)
    forwards = sum(x["target_forwards"] for x in samples)
    return TauResult(tokens / max(forwards, 1), (accepted / proposed.clamp(min=1)).tolist(), tokens, samples)


def learning_curve(run_dir, target_model, tokenizer, prompt_ids: list[list[int]], *, gamma: int = 4,
                   max_new_tokens: int = 64, temperature: float = 0.0, log: Callable[[str], None] = print,
                   progress: bool = True, last_only: bool = False, steps: Optional[list[int]] = None,
                   categories: Optional[list[Optional[str]]] = None) -> list[CurvePoint]:
    """steps: score only the checkpoints of these steps (each must exist); categories (per prompt) go into samples."""
    from tqdm.auto import tqdm

    from specdistill.tokens import eos_ids
    from specdistill.drafts import load_trained_draft
    from specdistill.drafts.base import cast_for_decoding
    from specdistill.train.checkpoint import list_checkpoints

    run_dir = Path(run_dir)
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint (checkpoints/step-N/): train first, or keep "
                                "more with trainer.keep_checkpoints")
    ckpts = ckpts[-1:] if last_only else ckpts
    if steps:
        have = {int(c.name.split("-")[-1]): c for c in ckpts}
        absent = sorted(set(steps) - set(have))
        if absent:
            raise FileNotFoundError(f"{run_dir} has no checkpoint of step(s) {absent}; it keeps {sorted(have)} "
                                    "(trainer.keep_checkpoints keeps more)")
        ckpts = [have[s] for s in sorted(set(steps))]
    eos = eos_ids(tokenizer, target_model, False)
    points = []
    for ck in tqdm(ckpts, desc="learning curve", unit="ckpt", disable=not progress):
        state = json.loads((ck / "trainer_state.json").read_text())
        draft = cast_for_decoding(load_trained_draft(str(ck / "draft")), target_model).eval().requires_grad_(False)
        res = tau_of(target_model, draft, prompt_ids, gamma=gamma, max_new_tokens=max_new_tokens, eos=eos,
                     temperature=temperature)
        pt = CurvePoint(int(state["step"]), int(state.get("tokens_seen", 0)),
                        round(checkpoint_wall_minutes(run_dir, ck, state), 2), res.tau, res.accept_rate_per_pos,
                        len(prompt_ids), res.new_tokens,
                        [{**x, "category": categories[x["prompt"]]} if categories else x for x in res.samples])
        log(f"[curve] step {pt.step}: tau {res.tau:.3f}, a_k {[round(a, 3) for a in res.accept_rate_per_pos]}")
        points.append(pt)
    return points


def write_curve(points: list[CurvePoint], out_dir, command: str, label: str = "", extra: Optional[dict] = None):
    """curve.json, curve.md and curve.png (tau against training tokens and against wall minutes)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"command": command, "label": label, "points": [asdict(p) for p in points], **(extra or {})}
    tmp = out_dir / "curve.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, out_dir / "curve.json")
    rows = ["| step | training tokens | wall min | tau | a_1 .. a_k |", "|---|---|---|---|---|"]
    rows += [f"| {p.step} | {p.tokens_seen:,} | {p.wall_minutes:.1f} | {p.tau:.3f} | "
             f"{', '.join(f'{a:.2f}' for a in p.accept_rate_per_pos)} |" for p in points]
    (out_dir / "curve.md").write_text(f"{label}\n\n`{command}`\n\n" + "\n".join(rows) + "\n")
    plot_curves({label or "run": points}, out_dir / "curve.png")
    return out_dir


def plot_curves(curves: dict[str, list[CurvePoint]], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in curves.items():
        if len(pts) < 2:
            continue  # a single point is not a curve
        n = f" (n={pts[0].prompts})" if pts[0].prompts else ""  # held-out proxy curves decode no prompts
        axes[0].plot([p.tokens_seen for p in pts], [p.tau for p in pts], "o-", label=name + n)
        axes[1].plot([p.wall_minutes for p in pts], [p.tau for p in pts], "o-", label=name)
    for ax, xl in zip(axes, ("training loss tokens", "training wall minutes")):
        ax.set_xlabel(xl)
        ax.set_ylabel("tau (tokens / target forward)")
        ax.set_ylim(bottom=1.0)  # tau >= 1 always: the axis starts at its floor
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heldout_curve(run_dir) -> list[CurvePoint]:
    """The in-training held-out proxy of a run as a curve, read from its metrics.jsonl (no decoding): simulated tau
    (heldout/mean_accept_len, the TTT unroll's chained greedy acceptance on held-out conversations of the training
    distribution) at each eval, against loss tokens and the loop's wall clock (train/heldout_log.py reads them).
    prompts/new_tokens: held-out positions."""
    from specdistill.train.heldout_log import read_heldout_log

    points = [CurvePoint(step=p.step, tokens_seen=p.tokens_seen, wall_minutes=p.wall_s / 60, tau=p.heldout_tau,
                         accept_rate_per_pos=p.accept_rate_per_pos, prompts=0, new_tokens=p.num_positions)
              for p in read_heldout_log(run_dir, before=False).points]
    if not points:
        raise ValueError(f"{run_dir}/metrics.jsonl has no held-out evals with tokens_seen (trainer.eval_every=0?)")
    return points
