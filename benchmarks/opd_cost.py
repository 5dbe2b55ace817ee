"""Cost of a Draft-OPD step against the off-policy objective's step: per trained position and per step at equal rows.

  python -m benchmarks.opd_cost --steps 5 draft.path=<a trained EAGLE-3 head> [shared Hydra overrides]
      [--onpolicy objective.max_new_tokens=128 ...] [--offpolicy objective.steps=7 ...]

Two arms, each its recipe (--onpolicy-recipe draft_opd, --offpolicy-recipe eagle3) composed with the shared overrides
(then --onpolicy / --offpolicy overrides of its own), built as train.py builds it (cached stages reused; both arms are
built first, so the target is in memory twice), one warm-up step each (the first step's one-off work: allocations,
the first rollout's caches and graphs; nothing here counts FLOPs, and the training loop's FLOP-counted first step
has no counterpart among the timed ones), then --steps timed optimizer steps each (steps 2 .. steps + 1) on the run's
own micro-batches, the arms taking them in turn (on-policy, off-policy, on-policy, ...), so that a machine whose
speed drifts during the run slows both arms alike. Per arm: seconds per step (and the share spent
in prepare(): Draft-OPD's rollouts), trained positions per step (the objective's num_tokens: drafted + replayed
positions for Draft-OPD, loss tokens x unrolled steps for eagle3), seconds per trained position, and the target's
forwards and fed tokens per step (padding included: the compute spent), and rows per step (prompts rolled out, or
sequences trained on). The step ratio divides the arms' seconds per row: equal rows when both arms take the same
micro-batches (shared trainer.micro_batch_size and grad_accum). Writes <out>/opd_cost.json and opd_cost.md.
Run it on an otherwise idle machine.

--parts N: N more on-policy steps after the timed ones, with a timer around each part of the step (the target's
prefill and verify forwards, the draft's proposals, verification, turning rounds into positions, the loss forward and
backward, the optimizer; "rest of the rollout" and "rest of the step" are what the timers leave). The timers
synchronize the device around every timed call, so these steps are reported apart (`parts` in the JSON, a table in
the markdown) and never mixed into the step times above.
"""
from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path



@dataclass
class ArmCost:
    recipe: str
    overrides: list[str]
    steps: int
    seconds_per_step: float
    prepare_seconds_per_step: float   # no-grad work before the loss (Draft-OPD: rollouts, replay)
    positions_per_step: float         # trained positions (the objective's num_tokens, summed over micro-batches)
    seconds_per_position: float
    target_forwards_per_step: float
    target_tokens_per_step: float     # tokens fed to the target (input_ids.numel(): padding and stopped rows included)
    rows_per_step: float = 0.0        # micro-batch rows (on-policy: prompts rolled out; off-policy: sequences)
    parts: dict = field(default_factory=dict)  # --parts: seconds per step by part (PARTS, then the rests)

    @property
    def seconds_per_row(self) -> float:
        return self.seconds_per_step / max(self.rows_per_step, 1)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps per arm (after one warm-up step)")
    ap.add_argument("--onpolicy-recipe", default="draft_opd")
    ap.add_argument("--offpolicy-recipe", default="eagle3")
    ap.add_argument("--onpolicy", action="append", default=None, metavar="OVERRIDE",
                    help="an override of the on-policy arm only (repeatable; default: draft=eagle3)")
    ap.add_argument("--offpolicy", action="append", default=[], metavar="OVERRIDE",
                    help="an override of the off-policy arm only (repeatable)")
    ap.add_argument("--parts", type=int, default=0, metavar="N",
                    help="N more on-policy steps with a timer around each part of the step, reported apart")
    ap.add_argument("--out", default="outputs/opd_cost")
    own, shared = ap.parse_known_args(argv)
    own.onpolicy = ["draft=eagle3"] if own.onpolicy is None else own.onpolicy
    if own.steps < 1:
        ap.error(f"--steps must be >= 1, got {own.steps}")
    return own, shared


def _clock(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Arm:
    """One recipe's components, built as train.py builds them, and its optimizer steps on its own micro-batches."""

    def __init__(self, recipe: str, overrides: list[str], out_dir: Path):
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from specdistill.config import CONF_DIR, register_configs
        from specdistill.data.loader import StepBatches
        from specdistill.pipeline.run import build_components
        from specdistill.tensors import unwrap_target

        register_configs()
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"recipe={recipe}"] + overrides +
                          [f"trainer.output_dir={out_dir / recipe}", "trainer.measure_roofline=false"])
        self.recipe, self.overrides, self.cfg = recipe, overrides, cfg
        self.c = build_components(cfg)
        t = cfg.trainer
        self.batches = StepBatches(self.c.data.train, t.micro_batch_size, t.grad_accum,
                                   self.c.models.tokenizer.pad_token_id, t.seed)
        self.target = unwrap_target(self.c.models.target)
        self.device = next(self.target.parameters()).device
        self.timers = PartTimers(self.device)
        self.fed = {"forwards": 0, "tokens": 0}
        self.runs: list[tuple[float, float, int, int]] = []

    def step(self, step: int) -> tuple[float, float, int, int]:
        """(seconds, seconds in prepare, trained positions, rows) of one optimizer step."""
        obj, models, opt, timers, device = self.c.objective, self.c.models, self.c.optimizer, self.timers, self.device
        t0 = _clock(device)
        micro = list(self.batches.micro_batches(step))
        p0 = _clock(device)
        obj.prepare_step(micro, models)  # the loop's order: the step-wide work, then each micro-batch
        prep_s, n, rows = _clock(device) - p0, 0, 0
        for b in micro:
            rows += b["input_ids"].shape[0]
            p0 = _clock(device)
            p = obj.prepare(b, models)
            prep_s += _clock(device) - p0
            k = int(obj.num_tokens(p))
            n += k
            with timers.part("loss forward"):
                out = obj.loss(p, models)
            with timers.part("loss backward"):
                (out.loss * (1 if out.weight is None else out.weight)).sum().div(max(k, 1)).backward()
        obj.end_step()
        with timers.part("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        total = _clock(device) - t0
        timers.add("prepare (rollout)", prep_s)
        timers.add("step", total)
        return total, prep_s, n, rows

    def timed_step(self, step: int) -> None:
        """One step counted in the arm's figures, with the target's forwards and fed tokens counted: its eager
        forwards by a forward hook, its compiled decode steps (graphs replayed, which run no module hooks) at the
        compiled cache's run."""
        from specdistill.decoding.compiled import _Slot

        def fed(ids) -> None:
            self.fed["forwards"] += 1
            self.fed["tokens"] += 0 if ids is None else ids.numel()

        def count(module, args, kwargs, output):
            fed(kwargs.get("input_ids", args[0] if args else None))

        run = _Slot.run

        def counted_run(slot, input_ids, *args, **kwargs):
            if slot.decoding.model() is self.target:
                fed(input_ids)
            return run(slot, input_ids, *args, **kwargs)

        hook = self.target.register_forward_hook(count, with_kwargs=True)
        _Slot.run = counted_run
        try:
            self.runs.append(self.step(step))
        finally:
            _Slot.run = run
            hook.remove()

    def parts(self, first: int, steps: int) -> dict:
        """`steps` more steps timed part by part (PartTimers), reported apart from the timed ones."""
        with self.timers.timing():
            for s in range(first, first + steps):
                self.step(s)
        return self.timers.per_step(steps)

    def cost(self, by_part: dict) -> ArmCost:
        steps = len(self.runs)
        seconds, prep, positions, rows = (sum(r[i] for r in self.runs) for i in range(4))
        return ArmCost(self.recipe, self.overrides, steps, seconds / steps, prep / steps, positions / steps,
                       seconds / max(positions, 1), self.fed["forwards"] / steps, self.fed["tokens"] / steps,
                       rows / steps, by_part)


def measure_arms(arms: dict[str, tuple[str, list[str]]], steps: int, out_dir: Path, parts: int = 0
                 ) -> dict[str, ArmCost]:
    """Build every arm, one warm-up step each (allocations, the first rollout's caches and compiled graphs), then
    `steps` timed steps taken in turn, one per arm (a drifting machine slows every arm alike), then `parts` steps of
    the first arm timed part by part (PartTimers)."""
    built = {name: Arm(recipe, overrides, out_dir) for name, (recipe, overrides) in arms.items()}
    for arm in built.values():
        arm.step(0)
    for s in range(1, 1 + steps):
        for arm in built.values():
            arm.timed_step(s)
    first = next(iter(built))
    return {name: arm.cost(arm.parts(1 + steps, parts) if parts and name == first else {})
            for name, arm in built.items()}


# Each timed part: (label, module, attribute path); a method is timed on its class, where it is defined.
PARTS = [("prefills", "specdistill.decoding.kv", "BatchKV.prefill"),
         ("target verify forwards", "specdistill.decoding.kv", "BatchKV.step"),
         ("draft proposals", "specdistill.decoding.drafters", "Drafter.propose"),
         ("verification", "specdistill.decoding.generate", "verify"),
         ("rounds to positions", "specdistill.onpolicy.rollout", "positions_from_rounds")]


class PartTimers:
    """Seconds spent in each part of a step, the device synchronized around every timed call. Outside timing() only
    the loop's own parts (loss, optimizer, totals) are recorded, and nothing is wrapped. Only the outermost timed
    call counts: the prefill's own forward is the prefill's, an LM draft's cache steps are its proposals'."""

    def __init__(self, device):
        self.device, self.active, self.seconds, self._depth = device, False, {}, 0

    def add(self, label: str, seconds: float) -> None:
        if self.active:
            self.seconds[label] = self.seconds.get(label, 0.0) + seconds

    @contextmanager
    def part(self, label: str):
        if not self.active or self._depth:
            yield
            return
        self._depth += 1
        t0 = _clock(self.device)
        try:
            yield
        finally:
            self._depth -= 1
            self.add(label, _clock(self.device) - t0)

    def _wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.part(label):
                return fn(*args, **kwargs)
        return timed

    @contextmanager
    def timing(self):
        """Wrap every PARTS entry (on each drafter class that defines propose) for the duration."""
        import importlib

        from specdistill.decoding.drafters import Drafter

        patched = []
        for label, module, path in PARTS:
            owner = importlib.import_module(module)
            *outer, name = path.split(".")
            for attr in outer:
                owner = getattr(owner, attr)
            owners = [owner]
            if owner is Drafter:
                todo, owners = [Drafter], []
                while todo:
                    cls = todo.pop()
                    owners += [cls] if name in vars(cls) else []
                    todo += cls.__subclasses__()
            for o in owners:
                patched.append((o, name, vars(o)[name]))
                setattr(o, name, self._wrap(label, getattr(o, name)))
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for o, name, original in reversed(patched):
                setattr(o, name, original)

    def per_step(self, steps: int) -> dict[str, float]:
        """Seconds per step: each part, then the rest of the rollout (prepare minus its timed parts) and of the step."""
        s = {k: v / steps for k, v in self.seconds.items()}
        rollout = [label for label, _, _ in PARTS]
        out = {k: s.get(k, 0.0) for k in rollout}
        out["rest of the rollout"] = s.get("prepare (rollout)", 0.0) - sum(out.values())
        for k in ("loss forward", "loss backward", "optimizer"):
            out[k] = s.get(k, 0.0)
        out["rest of the step"] = s.get("step", 0.0) - s.get("prepare (rollout)", 0.0) - sum(
            s.get(k, 0.0) for k in ("loss forward", "loss backward", "optimizer"))
        out["step"] = s.get("step", 0.0)
        return out


def markdown(arms: dict[str, ArmCost], ratio: float, step_ratio: float, command: str) -> str:
    lines = [f"`{command}`", "", "| arm | recipe | s / step | prepare s / step | rows / step "
             "| trained positions / step | ms / trained position | target forwards / step | target tokens / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, a in arms.items():
        lines.append(f"| {name} | {a.recipe} | {a.seconds_per_step:.3f} | {a.prepare_seconds_per_step:.3f} | "
                     f"{a.rows_per_step:.0f} | {a.positions_per_step:.1f} | {1000 * a.seconds_per_position:.3f} | "
                     f"{a.target_forwards_per_step:.1f} | {a.target_tokens_per_step:.0f} |")
    lines += ["", f"on-policy / off-policy seconds per trained position: **{ratio:.2f}x**",
              f"on-policy / off-policy seconds per step at equal rows (per row): **{step_ratio:.2f}x**"]
    for name, a in arms.items():
        if a.parts:
            total = a.parts["step"] or 1.0
            lines += ["", f"Where the {name} step's time goes (--parts: steps of their own, the device synchronized "
                      "around each part):", "", "| part | s / step | share |", "|---|---|---|"]
            lines += [f"| {k} | {v:.3f} | {100 * v / total:.0f}% |" for k, v in a.parts.items() if k != "step"]
            lines += [f"| step | {total:.3f} | 100% |"]
    return "\n".join(lines) + "\n"


def start(module: str, parse, argv=None):
    """A benchmark's start: (its own arguments, the Hydra overrides, the command line that reproduces it, its output
    folder, made)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = parse(argv)
    out = Path(own.out)
    out.mkdir(parents=True, exist_ok=True)
    return own, overrides, f"python -m {module} " + " ".join(shlex.quote(a) for a in argv), out


def main(argv=None) -> dict:
    own, shared, command, out = start("benchmarks.opd_cost", parse_args, argv)
    arms = measure_arms({"onpolicy": (own.onpolicy_recipe, shared + own.onpolicy),
                         "offpolicy": (own.offpolicy_recipe, shared + own.offpolicy)}, own.steps, out, own.parts)
    ratio = arms["onpolicy"].seconds_per_position / arms["offpolicy"].seconds_per_position
    step_ratio = arms["onpolicy"].seconds_per_row / arms["offpolicy"].seconds_per_row
    result = {"command": command, "arms": {k: asdict(v) | {"seconds_per_row": v.seconds_per_row}
                                           for k, v in arms.items()},
              "ratio_seconds_per_position": ratio, "ratio_seconds_per_step_equal_rows": step_ratio}
    (out / "opd_cost.json").write_text(json.dumps(result, indent=1))
    md = markdown(arms, ratio, step_ratio, command)
    (out / "opd_cost.md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
