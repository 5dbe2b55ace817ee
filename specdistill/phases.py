"""Training phases: which objective, micro-batch stream and learning-rate segment each optimizer step belongs to.

Knows nothing about the loop, models or tensors: a pure plan made from the config and the training set's size.
A run is a list of phases in order. Every recipe has one phase, "main" (the `objective`, trainer.max_steps /
trainer.epochs long); a `warmup:` block (config.WarmupConfig; recipe=draft_opd) puts a "warmup" phase before it.

The optimizer and schedule story, in one place:
  - ONE AdamW over the draft's parameters for the whole run: its moments carry across the hand-over.
  - The learning rate RESTARTS at every phase: phase k warms up linearly from 0 over its warmup_steps to its own lr,
    then decays by cosine to lr * trainer.min_lr_ratio at its horizon: trainer.schedule_steps (the warm-up's:
    warmup.schedule_steps), or else the phase's own length, so its last step trains at the floor, also when
    trainer.epochs ends a run long before trainer.max_steps (recipe=eagle3_serve: max_steps 100000, a few epochs).
  - Phase k reads its own micro-batch stream from its first step: StepBatches(seed = trainer.seed + k), phase step
    s = global step - phase.start reads micro_batches(s). With the step it is a pure function, so a resume at any
    global step (inside a phase or on the boundary) reads what an uninterrupted run reads.
Data: both phases of recipe=draft_opd read the same training set (the regenerated store of recipe=eagle3_serve). The
warm-up's eagle3 objective trains on its answers and the features stored with them; the on-policy draft_opd objective
reads only each row's prompt (objective.prompts=null) and decodes its own answer, or takes prompts from
objective.prompts, and then the rows only pace the loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from specdistill.config import Config, TrainerConfig, WarmupConfig
from specdistill.data.loader import StepBatches


def cosine_with_warmup(step: int, warmup_steps: int, horizon: int, min_ratio: float) -> float:
    """The LR factor of transformers' get_cosine_with_min_lr_schedule_with_warmup (num_cycles 0.5) at `step`. Written
    out because transformers' schedulers span one run from step 0; a restart per phase needs the factor as a function
    of the phase's own step (the same formula, so a one-phase run's learning rates are transformers' to the bit)."""
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    progress = float(step - warmup_steps) / float(max(1, horizon - warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0.0, factor * (1 - min_ratio) + min_ratio)


@dataclass
class Phase:
    name: str                 # "warmup" | "main"
    objective: Any            # objectives.base.Objective
    batches: StepBatches      # this phase's micro-batches: batches.micro_batches(step - start)
    start: int                # first global optimizer step
    steps: int                # optimizer steps
    lr: float                 # peak learning rate
    warmup_steps: int         # linear LR warm-up (phase steps)
    horizon: int              # cosine decay length (phase steps)
    min_lr_ratio: float
    epoch_offset: int = 0     # epochs of the phases before this one (epoch numbers run on across phases)

    @property
    def end(self) -> int:
        return self.start + self.steps

    def local(self, step: int) -> int:
        """The phase's own step of global step `step`."""
        return step - self.start

    def factor_at(self, step: int) -> float:
        """The schedule's factor (0..1) of its lr at global step `step`."""
        return cosine_with_warmup(self.local(step), self.warmup_steps, self.horizon, self.min_lr_ratio)

    def lr_at(self, step: int) -> float:
        return self.lr * self.factor_at(step)

    @property
    def epochs(self) -> int:
        return -(-self.steps // self.batches.steps_per_epoch)

    def epoch_done(self, steps_done: int) -> bool:
        """After `steps_done` global steps: the phase finished an epoch of its data, or the phase itself."""
        return self.local(steps_done) % self.batches.steps_per_epoch == 0 or steps_done == self.end


@dataclass
class PhasePlan:
    phases: list[Phase]
    base_lr: float  # the optimizer's lr (trainer.lr); the LambdaLR scheduler multiplies it by lr_factor(step)

    def __post_init__(self):
        if not self.phases or any(p.steps < 1 for p in self.phases):
            raise ValueError(f"every training phase needs >= 1 step: {self.describe()}")

    @property
    def total_steps(self) -> int:
        return self.phases[-1].end

    @property
    def main(self) -> Phase:
        return self.phases[-1]

    def at(self, step: int) -> Phase:
        """The phase that runs global step `step` (0-based; past the end: the last phase)."""
        return next((p for p in self.phases if step < p.end), self.phases[-1])

    def lr_factor(self, step: int) -> float:
        """LambdaLR's factor for global step `step`: the step's phase lr and schedule, over the optimizer's lr."""
        phase = self.at(step)
        return phase.lr / self.base_lr * phase.factor_at(step)  # the ratio is 1.0 for the main phase

    def epoch_of(self, step: int) -> int:
        p = self.at(step)
        return p.epoch_offset + p.batches.epoch_of(max(p.local(step), 0))

    def describe(self) -> list[dict]:
        """What a checkpoint records of the plan (trainer_state.json) and a resume compares."""
        return [{"name": p.name, "objective": p.objective.name, "start": p.start, "steps": p.steps}
                for p in self.phases]

    # The phases' objectives' states, saved per rank with a checkpoint (train/checkpoint.py). One phase: that
    # objective's own state_dict, unkeyed; several: keyed by phase name.
    def state_dict(self) -> dict:
        if len(self.phases) == 1:
            return self.phases[0].objective.state_dict()
        states = {p.name: p.objective.state_dict() for p in self.phases}
        return {"phases": {k: v for k, v in states.items() if v}} if any(states.values()) else {}

    def load_state_dict(self, state: dict) -> None:
        if len(self.phases) == 1:
            self.phases[0].objective.load_state_dict(state)
            return
        for p in self.phases:
            if p.name in state.get("phases", {}):
                p.objective.load_state_dict(state["phases"][p.name])


def warmup_runs(cfg: Config) -> bool:
    """Whether the warm-up phase runs: warmup.mode=always, or auto without a trained draft at draft.path."""
    from specdistill.drafts import reads_draft_path

    mode = cfg.warmup.mode
    return mode == "always" or (mode == "auto" and not (cfg.draft.path and reads_draft_path(cfg.draft.init)))


def warmup_objective(cfg: Config) -> Optional[Any]:
    """The warm-up phase's objective (its dataclass, from warmup.objective or the kind's own warm-up objective), or None
    when no warm-up runs. Bad settings fail here, before anything is loaded, with the key and the fix in the message."""
    from specdistill.drafts import kind_for_init, reads_draft_path
    from specdistill.objectives import make_objective

    w = cfg.warmup
    if w.mode == "always" and cfg.draft.path and reads_draft_path(cfg.draft.init):
        raise ValueError(f"warmup.mode=always with draft.path={cfg.draft.path}: the warm-up would retrain a draft that "
                         "is already trained. Drop draft.path to warm up from scratch, or set warmup.mode=auto (the "
                         "trained draft skips the warm-up)")
    if not warmup_runs(cfg):
        return None
    if (w.steps is None) == (w.epochs is None):
        raise ValueError(f"warmup: give its length as exactly one of warmup.steps (optimizer steps) or warmup.epochs "
                         f"(over the training data); got steps={w.steps}, epochs={w.epochs}")
    if w.objective is None:
        raise ValueError("warmup.objective is not set: give the warm-up's objective, e.g. warmup.objective={name: "
                         "eagle3, steps: 4, decay: 0.8} (recipe=draft_opd sets it)")
    raw = w.objective
    kind = kind_for_init(cfg.draft.init).spec
    trains_kind = kind.data_objective  # the objective that trains this draft kind on data
    if isinstance(raw, dict) and raw.get("name") != trains_kind and kind.warmup_objective is not None:
        raw = dict(kind.warmup_objective)  # e.g. a DFlash draft's block loss, where the recipe warms up a head
    objective = make_objective(raw, "warmup.objective")
    if objective.name != trains_kind:
        raise ValueError(f"warmup.objective.name={objective.name!r} cannot train draft.init={cfg.draft.init!r}: its "
                         f"kind trains on data with objective {trains_kind!r} (an EAGLE-3 head: eagle3; a standalone "
                         f"LM draft: kd): set warmup.objective.name={trains_kind}")
    return objective


def plan_phases(t: TrainerConfig, w: WarmupConfig, objective, train_set, pad_id: int, rank: int = 0,
                world: int = 1) -> PhasePlan:
    """The run's phases over `train_set` for this rank (w.objective None: the main phase alone)."""
    phases: list[Phase] = []
    if w.objective is not None:
        batches = StepBatches(train_set, w.micro_batch_size or t.micro_batch_size, w.grad_accum or t.grad_accum,
                              pad_id, t.seed, rank, world)
        steps = w.steps if w.steps is not None else w.epochs * batches.steps_per_epoch
        phases.append(Phase("warmup", w.objective, batches, 0, steps,
                            lr=w.lr if w.lr is not None else t.lr,
                            warmup_steps=w.warmup_steps if w.warmup_steps is not None else t.warmup_steps,
                            horizon=w.schedule_steps or steps, min_lr_ratio=t.min_lr_ratio))
    start = phases[-1].end if phases else 0
    offset = phases[-1].epochs if phases else 0
    batches = StepBatches(train_set, t.micro_batch_size, t.grad_accum, pad_id, t.seed + len(phases), rank, world)
    steps = t.max_steps if t.epochs is None else min(t.max_steps, t.epochs * batches.steps_per_epoch)
    phases.append(Phase("main", objective, batches, start, steps, lr=t.lr, warmup_steps=t.warmup_steps,
                        horizon=max(t.schedule_steps or steps, 1), min_lr_ratio=t.min_lr_ratio, epoch_offset=offset))
    return PhasePlan(phases, base_lr=t.lr)


def _fixed(described: list[dict]) -> list[dict]:
    """What a resume must keep: every phase, its objective and start, and every length but the last phase's (a longer or
    shorter trainer.max_steps is a resume's business, as in a run of one phase)."""
    return [{k: v for k, v in d.items() if not (k == "steps" and i == len(described) - 1)}
            for i, d in enumerate(described)]


def check_resume_phases(saved: Optional[list], plan: PhasePlan, allow_drift: bool,
                        log: Callable[[str], None] = print) -> None:
    """A checkpoint's phases (trainer_state.json) must be the run's: else step s would train another objective or
    read other data. Refused unless trainer.resume_allow_drift (checkpoints from before phases existed: not compared).
    The last phase's length may change (trainer.max_steps), as it always could."""
    if saved is None or _fixed(saved) == _fixed(plan.describe()):
        return
    msg = (f"the checkpoint's training phases {saved} differ from this run's {plan.describe()} (warmup.*, draft.path "
           "with warmup.mode=auto, or a phase length changed)")
    if not allow_drift:
        raise ValueError(f"trainer.resume: {msg}. Fix: resume with the checkpoint's settings, or pass "
                         "trainer.resume_allow_drift=true to continue anyway (not an exact resume)")
    log(f"[train] warning: trainer.resume_allow_drift=true: {msg}; this resume is not exact")
