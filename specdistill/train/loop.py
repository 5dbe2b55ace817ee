"""THE training loop: accumulate, normalise by the global loss-token count, step, log, evaluate, checkpoint.

It never branches on the objective: an objective turns a batch into per-token losses (StepOutput) and everything
else (normalisation, accumulation, clipping, schedule, logging, eval cadence, checkpoints, resume) lives here. Which
objective, micro-batches and learning rate a step has comes from the run's phase plan (specdistill/phases.py: one
phase, or recipe=draft_opd's warm-up then on-policy); a phase's end is logged, evaluated and checkpointed.

fit reads as its steps: the resume point, the run's folder, the start state (a RunState: everything carried from one
step to the next), then per optimizer step _enter_phase, _stopped (signal or wall-clock budget), _train_step and
_after_step (log, evaluate, epoch-end hooks, checkpoint), and _finish. A background thread (data/loader.py:
Prefetcher) loads and collates the next steps' micro-batches meanwhile.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shlex
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml
from tqdm.auto import tqdm

from specdistill.build import Components
from specdistill.phases import Phase, check_resume_phases
from specdistill.data.chat import collate
from specdistill.data.loader import Prefetcher
from specdistill.eval.simulated import simulated_acceptance
from specdistill.train.accelerate_compat import set_gradient_sync
from specdistill.train.checkpoint import check_resume_config, list_checkpoints, load_checkpoint, save_checkpoint
from specdistill.train import profile as step_profile
from specdistill.train.integrity import select_resume
from specdistill.train.results import drop_replayed, finished_run, nothing_to_do_message
from specdistill.train.throughput import DevicePeak, Mfu, count_flops, device_peak, step_flops


@dataclass
class FitResult:
    step: int
    final_checkpoint: Optional[Path]
    history: list[dict] = field(default_factory=list)  # every logged metrics dict
    heldout_before: Optional[dict] = None
    heldout_after: Optional[dict] = None
    # "SIGTERM" / "SIGINT" when a signal stopped the run (a resumable checkpoint exists)
    preempted: Optional[str] = None
    nothing_to_do: bool = False  # resumed at max_steps: no file was written (train/results.py)


@dataclass
class Saved:
    """What a checkpoint hook is told: a complete checkpoint folder (renamed into place) and when it was written."""
    path: Path
    epoch: int
    step: int
    final: bool  # the end of training
    metrics: dict


class StopSignal:
    """SIGTERM / SIGINT ask the loop to stop: it finishes the current optimizer step, all ranks agree (one all-reduce
    per step), a resumable checkpoint is written and fit returns (result.preempted). A second SIGINT interrupts at
    once. Handlers are only installed from the main thread and are restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: Optional[str] = None
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now, without a checkpoint
        self.requested = signal.Signals(signum).name

    def agreed(self, acc) -> bool:
        """True on every rank as soon as any rank got a signal."""
        if acc.num_processes == 1:
            return self.requested is not None
        flag = torch.tensor([float(self.requested is not None)], device=acc.device)
        return bool(acc.reduce(flag, "sum").item() > 0)


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def heldout_batches(c: Components) -> list[dict]:
    ds = c.data.heldout
    acc = c.accelerator
    n = c.trainer.micro_batch_size
    # Each rank scores its share once, and every rank gets the same number of batches: a sharded draft (FSDP,
    # ZeRO-3) runs collectives in its forward, and the acceptance counts are all-reduced after the last batch.
    usable = len(ds) // acc.num_processes * acc.num_processes
    idx = list(range(acc.process_index, usable, acc.num_processes))
    pad = c.models.tokenizer.pad_token_id
    chunks = [idx[i:i + n] for i in range(0, len(idx), n)][: c.eval.max_batches]
    return [collate([ds[i] for i in ch], pad) for ch in chunks]


def evaluate_heldout(c: Components) -> dict:
    acc = c.accelerator
    batches = [_to_device(b, acc.device) for b in heldout_batches(c)]
    with acc.autocast():
        sim = simulated_acceptance(c.models.draft, c.models.target, batches, c.eval.gamma,
                                   reduce=lambda t: acc.reduce(t.to(acc.device), "sum"))
    out = {f"heldout/{k}": v for k, v in sim.to_dict().items()}
    out.update({f"heldout/accept_rate_pos{k + 1}": a for k, a in enumerate(sim.accept_rate_per_pos)})
    return out


@dataclass
class Window:
    """The log window: since when, and how many loss tokens and steps, tokens/s and s/step are measured over."""
    t0: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    steps: int = 0
    data_wait_s: float = 0.0  # of it, seconds the loop waited for its batches

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


@dataclass
class RunState:
    """What fit carries from one step to the next; a checkpoint's trainer_state.json is written from it."""
    result: FitResult
    config_yaml: str                  # the run's resolved config (written beside every checkpoint)
    metrics_file: Path
    step: int = 0                     # optimizer steps taken (global, across phases)
    tokens_seen: int = 0              # loss tokens over all ranks
    last_saved: int = -1              # the step of the newest checkpoint (-1: none yet)
    wall_before: float = 0.0          # training wall seconds of the runs this one resumes
    t_start: float = field(default_factory=time.perf_counter)
    sums: dict = field(default_factory=dict)  # metric sums of the log window, reduced over ranks when logged
    window: Window = field(default_factory=Window)
    latest: dict = field(default_factory=dict)  # the latest logged metrics (saved with a checkpoint)
    phase: Optional[Phase] = None     # the phase of the current step
    bar: Any = None                   # its progress bar
    peak: Optional[DevicePeak] = None  # one device's dense matmul peak (trainer.measure_roofline)
    mfu: Optional[Mfu] = None  # counted on a phase's first step
    last_taken: Optional[StepTaken] = None  # the latest step's lr and grad norm (a stop logs the open window with it)
    profiled: Optional["Profiled"] = None  # trainer.profile_steps: the steps profiled so far

    def wall_s(self) -> float:
        """Training wall seconds, carried across resumes (the learning curves' x axis)."""
        return self.wall_before + time.perf_counter() - self.t_start


@dataclass
class StepTaken:
    """What the log needs of the optimizer step just taken."""
    lr: float                          # the learning rate it used
    grad_norm: Optional[torch.Tensor]  # before clipping; None without clipping


def fit(c: Components, epoch_end_hooks: tuple[Callable[[Components, int, int], dict], ...] = (),
        checkpoint_hooks: tuple[Callable[[Components, Saved], None], ...] = ()) -> FitResult:
    """Train until trainer.max_steps (or trainer.epochs), or until SIGTERM / SIGINT (then a resumable checkpoint is
    written and result.preempted says why). `epoch_end_hooks(c, epoch, step) -> metrics` run at the end of every epoch
    (the speculative evaluator plugs in there). `checkpoint_hooks(c, saved)` run on every rank once the checkpoint of
    an epoch end or of the end of training is complete (the hub push plugs in there); with such hooks a checkpoint is
    written at every epoch end."""
    config_yaml = c.config_yaml
    resume_from = _resume_point(c, config_yaml)
    done = finished_run(resume_from, c.phases.total_steps, c.output_dir)
    if done is not None:  # a finished run: every result file stays as it is
        c.accelerator.print(nothing_to_do_message(done, c.output_dir, c.phases.total_steps))
        return done
    _open_run(c, config_yaml)
    s = _start_state(c, resume_from, config_yaml)
    c.models.draft.train()
    with StopSignal() as stop, _prefetcher(c, s.step) as batches:
        while s.step < c.phases.total_steps:
            _enter_phase(c, s)
            if _stopped(c, s, stop):
                break
            profiled = s.profiled is not None and s.step in s.profiled.steps
            counted = s.peak is not None and s.mfu is None  # this step's FLOPs are counted (_train_step)
            with _outside_log_window(c, s) if profiled or counted else nullcontext():
                taken = _profiled_step(c, s, batches) if profiled else _train_step(c, s, batches)
            _after_step(c, s, taken, epoch_end_hooks, checkpoint_hooks)
        # A signal during the last step or its save: the checkpoint is whole, but the run stops here (no final
        # evaluation or export), as at any other step; trainer.resume=auto finishes them.
        if s.result.preempted is None and stop.agreed(c.accelerator):
            s.result.preempted = stop.requested or "a signal on another rank"
            c.accelerator.print(f"[train] {s.result.preempted} during the final checkpoint: stopped after it "
                                f"({s.result.final_checkpoint}); continue with trainer.resume=auto")
    if s.bar is not None:
        s.bar.close()
    return _finish(c, s)


def _resume_point(c: Components, config_yaml: str) -> Optional[Path]:
    """The verified checkpoint to resume from (None: a fresh run); a resume that would not be exact, or a fresh run
    into a folder holding checkpoints, is refused before anything else happens."""
    acc, t, out_dir = c.accelerator, c.trainer, c.output_dir
    resume_from = select_resume(t.resume, out_dir, acc, log=acc.print)  # verified; corrupt ones moved aside
    if resume_from is None and list_checkpoints(out_dir):
        raise FileExistsError(f"{out_dir} already holds checkpoints of an earlier run "
                              f"({list_checkpoints(out_dir)[-1].name}): continue it with trainer.resume=auto, or start "
                              "fresh in another trainer.output_dir (nothing is overwritten)")
    if resume_from is not None:
        check_resume_config(resume_from, config_yaml, t.resume_allow_drift, log=acc.print)
        check_resume_phases(json.loads((resume_from / "trainer_state.json").read_text()).get("phases"), c.phases,
                            t.resume_allow_drift, log=acc.print)
    return resume_from


def _open_run(c: Components, config_yaml: str) -> None:
    """The trackers, then the output folder's config and data report. trainer.wandb_mode=online that W&B refuses (no
    API key, a bad one) logs offline with a warning, as an unreachable server does (cli/train.py)."""
    acc, t, out_dir = c.accelerator, c.trainer, c.output_dir
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    if t.wandb:
        import wandb

        def init(mode: str) -> None:
            acc.init_trackers(t.wandb_project, config=yaml.safe_load(config_yaml),
                              init_kwargs={"wandb": {"name": c.run_name, "dir": str(out_dir), "mode": mode}})
        started = len(acc.trackers)
        try:
            init(t.wandb_mode)
        except (wandb.errors.UsageError, wandb.errors.CommError) as e:
            if t.wandb_mode != "online":
                raise
            del acc.trackers[started:]  # the refused tracker is listed before it starts: it must not start again
            os.environ["WANDB_MODE"] = "offline"
            acc.print(f"[train] warning: trainer.wandb_mode=online but W&B refused the run ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}): logging offline into "
                      f"{out_dir}/wandb instead; run `wandb login` and upload it later with `wandb sync "
                      f"{out_dir}/wandb/offline-run-*`, or pass trainer.wandb_mode=offline to skip the attempt")
            init("offline")
    if acc.is_main_process:
        (out_dir / "config.yaml").write_text(config_yaml)
        (out_dir / "data_report.json").write_text(json.dumps(c.data.report, indent=1))


def _start_state(c: Components, resume_from: Optional[Path], config_yaml: str) -> RunState:
    """The state at the first step: restored from the checkpoint, or fresh with the held-out metrics before training."""
    acc, t = c.accelerator, c.trainer
    s = RunState(FitResult(0, None), config_yaml, c.output_dir / "metrics.jsonl")
    if resume_from is not None:
        state = load_checkpoint(acc, resume_from, c.phases)  # every phase's objective state
        s.step, s.tokens_seen = state["step"], state["tokens_seen"]
        s.wall_before = float(state.get("wall_s", 0.0))
        s.last_saved = s.step
        s.result.heldout_before = state.get("heldout_before")
        acc.print(f"[train] resumed from {resume_from} at step {s.step}")
    else:
        s.result.heldout_before = evaluate_heldout(c)
        acc.print(f"[train] held-out before training: {json.dumps(s.result.heldout_before)}")
    if resume_from is None and acc.is_main_process and s.metrics_file.exists():
        s.metrics_file.unlink()  # a fresh run in an old output dir starts a fresh log (checkpoints are kept)
    if resume_from is not None and acc.is_main_process:
        drop_replayed(s.metrics_file, s.step)  # steps logged after the checkpoint are logged again as they replay
    # MFU: the device's dense peak measured before the first step, whose FLOPs are counted (train/mfu).
    if t.measure_roofline:
        s.peak = device_peak(acc.device, _train_dtype(acc))
        acc.print(f"[train] {s.peak.describe()}; train/mfu is a fraction of {s.peak.flops_per_s / 1e12:.4g} TFLOP/s "
                  f"({s.peak.source}) x {acc.num_processes} process(es)")
    if t.profile_steps:
        first = s.step + 2  # after the warm-up step and the FLOP-counted one
        s.profiled = Profiled(range(first, min(first + t.profile_steps, c.phases.total_steps)))
    s.window = Window()  # the first log window starts here (the wall clock at the state's creation)
    return s


@dataclass
class Profiled:
    """trainer.profile_steps: which steps are profiled, and the profiled work so far (summed over the steps)."""
    steps: range
    work: dict = field(default_factory=dict)  # name -> (seconds, calls)
    wall_s: float = 0.0
    taken: int = 0
    input_tokens: float = 0.0


@contextmanager
def _outside_log_window(c: Components, s: RunState):
    """A step that the FLOP counter or the profiler slows: its time, tokens and data wait stay out of the log window's
    rates (a window holding only such steps logs its loss but no rate: _log_window)."""
    if c.accelerator.device.type == "cuda":
        torch.cuda.synchronize(c.accelerator.device)  # the steps before finish inside the log window
    t_enter = time.perf_counter()
    tokens, steps, wait = s.window.tokens, s.window.steps, s.window.data_wait_s
    input_before = s.sums.get("input_tokens", 0)
    yield
    s.sums["input_tokens"] = input_before  # the loss sums keep the step (its loss is logged with the window's)
    s.window.tokens, s.window.steps, s.window.data_wait_s = tokens, steps, wait
    s.window.t0 += time.perf_counter() - t_enter


def _profiled_step(c: Components, s: RunState, batches: Prefetcher) -> StepTaken:
    """_train_step under torch.profiler; profile.json / profile.md are rewritten with every profiled step so far."""
    acc, p = c.accelerator, s.profiled
    input_before = s.sums.get("input_tokens", 0)
    with step_profile.profiling(acc.device) as box:
        taken = _train_step(c, s, batches)
    prof, wall = box
    step_input = float(s.sums["input_tokens"] - input_before)
    p.wall_s, p.taken, p.input_tokens = p.wall_s + wall, p.taken + 1, p.input_tokens + step_input
    for w in step_profile.profiled_work(prof, acc.device.type):
        seconds, calls = p.work.get(w.name, (0.0, 0))
        p.work[w.name] = (seconds + w.seconds, calls + w.calls)
    if acc.is_main_process:
        # this rank's device: its own real tokens' FLOPs over one device's peak
        flops = s.mfu.flops_per_token * p.input_tokens if s.mfu is not None else None
        summary = step_profile.summarize([step_profile.Work(n, sec, k) for n, (sec, k) in p.work.items()],
                                         acc.device.type, p.taken, p.wall_s, flops=flops,
                                         peak_flops_per_s=s.peak.flops_per_s if s.peak is not None else None)
        extra = {"steps_profiled": [p.steps.start, p.steps.start + p.taken],  # step indices from 0, end excluded
                 "peak": s.peak.as_dict() if s.peak is not None else None}
        step_profile.write(c.output_dir, summary, command=shlex.join(["python", *sys.argv]), extra=extra)
        if p.taken == len(p.steps):
            factors = summary.factors
            acc.print(f"[train] profiled steps {p.steps.start + 1}-{p.steps.stop} (as metrics.jsonl numbers them): "
                      f"the device busy "
                      f"{100 * summary.busy_fraction:.0f}% of the wall time"
                      + (f", matmul kernels at {100 * factors['matmul_rate_of_peak']:.0f}% of the peak and "
                         f"{100 * factors['matmul_share_of_busy']:.0f}% of the device's work" if factors else "")
                      + f"; {c.output_dir / 'profile.md'}")
    return taken


def _prefetcher(c: Components, start: int) -> Prefetcher:
    """Every remaining step's micro-batches, loaded ahead (trainer.prefetch_steps; 0: in the step, no thread)."""
    plan = c.phases

    def load(step: int) -> list[dict]:
        phase = plan.at(step)
        return phase.batches.micro_batches(phase.local(step))

    return Prefetcher(load, start, plan.total_steps, depth=c.trainer.prefetch_steps,
                      pin=c.accelerator.device.type == "cuda")


def _enter_phase(c: Components, s: RunState) -> None:
    """At the run's start or a hand-over: the next phase's progress bar (its objective and data come with it)."""
    if c.phases.at(s.step) is s.phase:
        return
    if s.bar is not None:
        s.bar.close()
    s.phase = c.phases.at(s.step)
    s.bar = _phase_bar(c, s.phase, s.step, many=len(c.phases.phases) > 1)
    s.mfu = None  # another objective: its FLOPs per token are counted on its first step


def _stopped(c: Components, s: RunState, stop: StopSignal) -> bool:
    """Before any work of a step (an on-policy step starts with rollouts): a signal on any rank or the wall-clock
    budget ends the run here, with a resumable checkpoint."""
    acc, t = c.accelerator, c.trainer
    if stop.agreed(acc):
        _log_open_window(c, s)
        if s.step > s.last_saved:
            s.result.final_checkpoint = _save(c, s)
        s.result.preempted = stop.requested or "a signal on another rank"
        acc.print(f"[train] {s.result.preempted}: stopped at step {s.step}, checkpoint {s.result.final_checkpoint}; "
                  "continue with trainer.resume=auto")
        return True
    if t.max_minutes is not None and _out_of_time(acc, s.wall_s(), t.max_minutes):
        _log_open_window(c, s)
        if s.step > s.last_saved:
            s.result.final_checkpoint = _save(c, s)
        acc.print(f"[train] trainer.max_minutes={t.max_minutes} reached at step {s.step}")
        return True
    return False


def _log_open_window(c: Components, s: RunState) -> None:
    """A run that stops between log steps logs the steps since the last one (every rank takes part: the stop is
    agreed), so a run shorter than trainer.log_every still has its metrics, and its checkpoint the latest of them."""
    if s.window.steps and s.last_taken is not None:
        _log_window(c, s, s.last_taken)


def _train_step(c: Components, s: RunState, batches: Prefetcher) -> StepTaken:
    """One optimizer step: the step's micro-batches forward and backward (accumulate), clip, step, schedule."""
    acc, t, draft = c.accelerator, c.trainer, c.models.draft
    objective = s.phase.objective
    wait_before = batches.wait_s
    micro = [_to_device(b, acc.device) for b in batches.get(s.step)]
    s.window.data_wait_s += batches.wait_s - wait_before
    # One micro-batch at a time, the gradient that of the mean over the step's global loss tokens (accumulate).
    if s.peak is not None and s.mfu is None:  # the first step is counted (its window includes
        counted = count_flops(lambda: accumulate(c, micro, s.sums, objective))  # the counter's small overhead)
        n_local, n_global = counted.result
        flops = step_flops(counted.flops, micro)  # per real token: padding slots do no useful work
        s.mfu = Mfu(s.peak.flops_per_s * acc.num_processes, flops.flops_per_token)
        per_slot = counted.recomputed / max(flops.slots, 1) / 1e6
        recomputed = f"; {per_slot:.1f} more recomputed by checkpointed layers, not counted" if per_slot else ""
        acc.print(f"[train] {flops.flops_per_token / 1e6:.1f} MFLOP per real token (forward + backward, torch's "
                  f"FlopCounterMode; {flops.tokens} real tokens in {flops.slots} slots{recomputed})")
    else:
        n_local, n_global = accumulate(c, micro, s.sums, objective)
    s.sums["tokens"] = s.sums.get("tokens", 0) + n_local.float()
    s.sums["input_tokens"] = s.sums.get("input_tokens", 0) + sum(b["attention_mask"].sum() for b in micro).float()
    grad_norm = acc.clip_grad_norm_(draft.parameters(), t.max_grad_norm) if t.max_grad_norm > 0 else None
    lr = c.scheduler.get_last_lr()[0]  # the learning rate of this step (logged; sched.step() moves to the next's)
    c.optimizer.step()
    c.scheduler.step()
    c.optimizer.zero_grad(set_to_none=True)
    s.step += 1
    s.tokens_seen += int(n_global.item())
    s.window.tokens += int(n_global.item())
    s.window.steps += 1
    s.bar.update(1)
    return StepTaken(lr, grad_norm)


def _after_step(c: Components, s: RunState, taken: StepTaken, epoch_end_hooks: tuple,
                checkpoint_hooks: tuple) -> None:
    """Log, evaluate, run the epoch-end hooks and checkpoint, each at its cadence; their time is kept out of the
    log window (tokens/s and s/step measure training alone)."""
    t, phase = c.trainer, s.phase
    s.last_taken = taken
    epoch_done = phase.epoch_done(s.step)  # an epoch of the phase's data, or the phase itself, is done
    phase_done = s.step == phase.end  # a hand-over (or the end): log, evaluate and checkpoint here
    if s.step % t.log_every == 0 or phase_done:
        _log_window(c, s, taken)
    t_pause = time.perf_counter()
    if (t.eval_every and s.step % t.eval_every == 0) or phase_done:
        s.latest.update(evaluate_heldout(c))
        _log(c.accelerator, {"phase": phase.name, **{k: v for k, v in s.latest.items() if k.startswith("heldout/")}},
             s.step, s.metrics_file)
    hook_error = _epoch_end(c, s, epoch_end_hooks) if epoch_done else None
    # every rank learns whether any rank failed, so all of them take part in the save
    failed = epoch_done and c.accelerator.reduce(
        torch.tensor(float(hook_error is not None), device=c.accelerator.device), "sum").item() > 0
    if s.step % t.save_every == 0 or phase_done or (epoch_done and checkpoint_hooks) or failed:
        s.result.final_checkpoint = _save(c, s)
        s.last_saved = s.step
        if epoch_done:
            saved = Saved(s.result.final_checkpoint, c.phases.epoch_of(s.step - 1), s.step,
                          s.step == c.phases.total_steps, dict(s.latest))
            for hook in checkpoint_hooks:
                hook(c, saved)
    if failed:
        raise hook_error if hook_error is not None else RuntimeError(
            f"an epoch-end hook failed on another rank at step {s.step}; checkpoint {s.result.final_checkpoint}")
    s.window.t0 += time.perf_counter() - t_pause


def _log_window(c: Components, s: RunState, taken: StepTaken) -> None:
    """The log window's metrics, reduced over ranks, into the history, the trackers and metrics.jsonl."""
    acc, phase, w = c.accelerator, s.phase, s.window
    keys = sorted(s.sums)
    totals = acc.reduce(torch.stack([torch.as_tensor(s.sums[k], device=acc.device) for k in keys]), "sum")
    red = dict(zip(keys, totals.tolist()))
    ntok = max(red.pop("tokens"), 1.0)
    n_input = red.pop("input_tokens")
    elapsed = max(w.elapsed(), 1e-9)
    s.latest = ratios(red, ntok)
    s.latest.update({"train/lr": taken.lr,
                     "train/grad_norm": float(taken.grad_norm) if taken.grad_norm is not None else math.nan,
                     "train/peak_mem_mb": peak_memory_mb(acc.device), "step": s.step,
                     "epoch": c.phases.epoch_of(s.step - 1), "tokens_seen": s.tokens_seen,
                     "wall_s": s.wall_s(), "phase": phase.name, "phase_step": phase.local(s.step)})
    if w.steps:  # rates: none for a window of FLOP-counted or profiled steps only (_outside_log_window)
        s.latest.update({"train/tokens_per_s": w.tokens / elapsed, "train/input_tokens_per_s": n_input / elapsed,
                         "train/s_per_step": elapsed / w.steps, "train/data_wait_fraction": w.data_wait_s / elapsed,
                         "eta_phase_s": elapsed / w.steps * (phase.end - s.step)})
    else:
        s.latest["train/instrumented"] = True
    budget = {}
    if c.trainer.max_minutes is not None:  # a wall-time budget ends the run first: the bar's step ETA is not the ETA
        left = max(60 * c.trainer.max_minutes - s.wall_s(), 0.0)
        s.latest["eta_phase_s"] = min(s.latest.get("eta_phase_s", left), left)
        budget = {"time_left": f"{int(left // 60)}:{int(left % 60):02d}"}
    if s.mfu is not None:
        s.latest["train/flops_per_token"] = s.mfu.flops_per_token
        if w.steps:
            s.latest.update(s.mfu.metrics(s.latest["train/input_tokens_per_s"]))
    s.bar.set_postfix(loss=f"{s.latest.get('train/loss', math.nan):.4f}",
                      tok_s=f"{s.latest.get('train/tokens_per_s', math.nan):.0f}", **budget)
    s.result.history.append(s.latest)
    _log(acc, s.latest, s.step, s.metrics_file)
    s.sums, s.window = {}, Window()


def _epoch_end(c: Components, s: RunState, hooks: tuple) -> Optional[Exception]:
    """Run the epoch-end hooks (their metrics join s.latest); the first failure is returned, to be raised once the
    trained weights are saved."""
    error = None
    for hook in hooks:
        try:
            s.latest.update(hook(c, c.phases.epoch_of(s.step - 1), s.step))
        except Exception as e:  # noqa: BLE001 - raised by _after_step after the checkpoint
            error = error or e
            c.accelerator.print(f"[train] epoch-end hook {getattr(hook, '__name__', hook)} failed at step {s.step}: "
                                f"{e!r}; saving a checkpoint before stopping")
    return error


def _save(c: Components, s: RunState) -> Path:
    """A checkpoint of the run at s.step: weights, optimizer, every phase's objective state and trainer_state."""
    plan, t = c.phases, c.trainer
    now = plan.at(max(s.step - 1, 0))  # the phase of the last step taken (at a hand-over: the one that ended)
    state = {"step": s.step, "epoch": plan.epoch_of(max(s.step - 1, 0)), "tokens_seen": s.tokens_seen,
             "phase": now.name, "phase_step": now.local(s.step), "phases": plan.describe(),
             "heldout_before": s.result.heldout_before, "wall_s": s.wall_s()}
    return save_checkpoint(c.accelerator, c.models.draft, c.models.tokenizer, c.output_dir, s.step, state, s.latest,
                           s.config_yaml, keep=t.keep_checkpoints, objective=plan, target=c.models.target)


def _finish(c: Components, s: RunState) -> FitResult:
    """The result, and summary.json beside the checkpoints."""
    acc, result = c.accelerator, s.result
    result.step = s.step
    result.heldout_after = {k: v for k, v in s.latest.items() if k.startswith("heldout/")} or None
    if acc.is_main_process:
        summary = {"step": s.step, "heldout_before": result.heldout_before, "heldout_after": result.heldout_after,
                   "final_checkpoint": str(result.final_checkpoint) if result.final_checkpoint else None,
                   "preempted": result.preempted, "num_processes": acc.num_processes,
                   "distributed_type": str(acc.distributed_type),
                   "torch_threads": torch.get_num_threads(),  # per process: throughput figures depend on it
                   "wall_s": s.wall_s(), "device_peak": s.peak.as_dict() if s.peak is not None else None,
                   "last_train_metrics": {k: v for k, v in s.latest.items() if k.startswith("train/")}}
        (c.output_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if c.trainer.wandb:
        acc.end_training()
    return result


def _out_of_time(acc, wall_s: float, max_minutes: float) -> bool:
    """Whether the wall-clock budget is spent, on any rank (all ranks stop at the same step)."""
    return acc.reduce(torch.tensor(float(wall_s >= 60 * max_minutes), device=acc.device), "max").item() > 0


def _global_sum(acc, n) -> torch.Tensor:
    """() the sum of a local count over ranks."""
    return acc.reduce(torch.as_tensor(n, device=acc.device).detach().clone(), "sum")


def accumulate(c: Components, micro: list[dict], sums: dict, objective=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one optimizer step's micro-batches, ONE at a time: a micro-batch is prepared (Draft-OPD:
    its rollout), its loss backpropagated and dropped before the next one is prepared, so only one micro-batch's
    prepared work (rollouts with their target logits) is resident. Metric sums are added to `sums`. Returns
    (n_local, n_global): this rank's and all ranks' loss tokens of the step.

    The gradient is that of the MEAN over the step's global loss tokens, however the batch is split over micro-batches
    and ranks. DDP averages gradients over ranks (hence the factor world below), on the last micro-batch's backward.
    - Objectives on the data's own loss tokens know each micro-batch's count before prepare
      (objective.num_tokens_before_prepare): n_global is all-reduced first and every backward is scaled by
      world / n_global.
    - On-policy objectives know a count only after prepare (num_tokens_before_prepare is None). Each micro-batch is
      backpropagated with the provisional scale world / n_est, n_est = (first micro-batch's global count) x (number of
      micro-batches), one scalar all-reduce after the first prepare (a step-wide constant, the same on every rank, that
      keeps the backward's magnitude near that of a mean: no fp16 overflow from an unnormalised sum). After the last
      backward (and so after DDP's all-reduce-average), every .grad is multiplied by n_est / n_global. Since gradients
      are linear in the loss, that equals backpropagating with world / n_global: exact, up to rounding. It needs the
      gradients in hand after backward: one process, DDP or FSDP (linear on shards alike). DeepSpeed steps its
      optimizer inside the last backward, so there (ZeRO-1/2; Draft-OPD refuses sharded drafts) every micro-batch is
      prepared first and held until its backward: exact, but all of a step's rollouts are alive at once.
    """
    acc, draft, world = c.accelerator, c.models.draft, c.accelerator.num_processes
    objective = objective if objective is not None else c.objective  # the step's phase's objective
    objective.prepare_step(micro, c.models)
    before = [objective.num_tokens_before_prepare(b) for b in micro]
    known = all(n is not None for n in before)
    scale = n_est = None
    held: Optional[list] = None
    if not known and _deepspeed(acc):  # no gradients to rescale after DeepSpeed's last backward: count first
        held = [objective.prepare(b, c.models) for b in micro]
        before, known = [objective.num_tokens(p) for p in held], True
    n_local = sum(before) if known else 0
    if known:
        n_global = _global_sum(acc, n_local).clamp_min(1)
        scale = world / n_global
    for i, b in enumerate(micro):
        if held is not None:
            p, held[i] = held[i], None  # dropped after its backward
        else:
            p = objective.prepare(b, c.models)
        if not known:  # counted after prepare
            n_i = objective.num_tokens(p)
            n_local = n_local + n_i
            if scale is None:  # the step's provisional scale, from the first micro-batch (see above)
                n_est = (_global_sum(acc, n_i) * len(micro)).clamp_min(1)
                scale = world / n_est
        last_micro = i == len(micro) - 1
        sync = nullcontext() if last_micro else acc.no_sync(draft)
        # DeepSpeed steps its engine inside backward when sync_gradients is set: on the last micro-batch.
        set_gradient_sync(acc, last_micro)
        with sync, acc.autocast():
            out = objective.loss(p, c.models)
            per_token = out.loss if out.weight is None else out.loss * out.weight
            acc.backward(per_token.sum() * scale)
        del p, per_token  # this micro-batch's prepared work goes before the next one is prepared
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0) + v.detach().float()
        del out
    for k, v in objective.end_step().items():  # deferred state updates (Draft-OPD: the replay buffer)
        sums[k] = sums.get(k, 0) + v.detach().float()
    if not known:
        n_global = _global_sum(acc, n_local).clamp_min(1)
        factor = n_est / n_global  # () tensor
        for param in draft.parameters():
            if param.grad is not None:
                param.grad.mul_(factor.to(param.grad.dtype))
    n_local = torch.as_tensor(n_local, device=acc.device)
    return n_local, n_global


def _phase_bar(c: Components, phase: Phase, step: int, many: bool):
    """The progress bar (with its ETA) of one phase: its own steps, from where a resume starts."""
    acc = c.accelerator
    name = f"train {c.run_name}" + (f" [{phase.name}: {phase.objective.name}]" if many else "")
    if many:
        source = c.data.report.get("source", "the training set")
        b = phase.batches
        acc.print(f"[train] phase {phase.name}: objective {phase.objective.name} on {source}, global steps "
                  f"{phase.start}-{phase.end - 1} ({phase.steps} steps, {b.steps_per_epoch} per epoch of "
                  f"{b.micro_batch_size} x {b.grad_accum}), lr {phase.lr:g} (its own warm-up over {phase.warmup_steps} "
                  "steps, then cosine)")
    acc.print(f"[train] lr {phase.lr:g}: linear warm-up over {phase.warmup_steps} steps, cosine to "
              f"{phase.lr * phase.min_lr_ratio:g} at phase step {phase.horizon} (of {phase.steps}; "
              "trainer.schedule_steps / warmup.schedule_steps set it)")
    return tqdm(total=phase.steps, initial=phase.local(step), desc=name, disable=not acc.is_local_main_process,
                dynamic_ncols=True)


def _deepspeed(acc) -> bool:
    return str(getattr(acc, "distributed_type", "")).endswith("DEEPSPEED")


def _train_dtype(acc) -> torch.dtype:
    """The dtype the step's matmuls run in: the autocast dtype under mixed precision, else fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(acc.mixed_precision), torch.float32)


def ratios(sums: dict, ntok: float) -> dict:
    """Turn reduced sums into logged ratios: `X_sum` / `X_count` where a count exists, else / loss tokens."""
    out = {}
    for k, v in sums.items():
        if k.endswith("_count"):
            continue
        base = k.removesuffix("_sum")
        out[f"train/{base}"] = v / max(sums.get(f"{base}_count", ntok), 1.0)
    return out


def _log(acc, metrics: dict, step: int, path: Path) -> None:
    acc.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
    if acc.is_main_process:
        with path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
