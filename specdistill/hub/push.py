"""Push a trained draft to the Hugging Face Hub after each epoch and at the end of training (hub.push=true).

What a push uploads (one commit): the checkpoint's HF-format draft at the repository root, README.md (the model card,
card.py), specdistill/config.yaml and specdistill/metrics.json and the serving exports of hub.serving_formats that
the draft's kind writes (an EAGLE-3 head: serving/vllm and serving/sglang; an LM draft: none). The folder is staged
from the complete checkpoint (hard links, so pruning old checkpoints cannot touch it) and uploaded on the main process
in a background thread, so training goes on (and other ranks never wait on the network). A push is retried with
exponential backoff a bounded number of times; a push that still fails is reported (printed and hub/push_log.jsonl)
and its staging folder kept for a manual upload. The local checkpoint is never modified. The token is
huggingface_hub's own (HF_TOKEN or `hf auth login`): this module never reads it except to scrub it from error
messages, and never prints or logs it.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from specdistill.config import Config, HubConfig
from specdistill.constraints import check_fields
from specdistill.validation import push_errors
from specdistill.hub.card import model_card

if TYPE_CHECKING:  # annotations only: the draft kinds are passed in
    from specdistill.drafts import DraftAdapter

NO_RETRY_STATUS = (400, 401, 403, 404)  # a bad token, no permission, a bad repo id: retrying cannot help


@dataclass
class PushRecord:
    step: int
    epoch: int
    final: bool
    ok: bool
    attempts: int
    seconds: float
    error: Optional[str] = None
    commit_url: Optional[str] = None
    staging: Optional[str] = None  # kept after a failure, for a manual `hf upload`


def serving_errors(hub: HubConfig) -> list[str]:
    from specdistill.drafts import export_formats

    return [f"hub.serving_formats: unknown format {f!r}; choose from {list(export_formats())}"
            for f in hub.serving_formats if f not in export_formats()]


def check_hub_config(hub: HubConfig) -> None:
    """Fail before any model is loaded on a push without a repository, or a hub setting outside the range its schema
    field declares (config.py's HubConfig)."""
    errors = push_errors(hub) + serving_errors(hub)
    if errors:
        raise ValueError(errors[0])
    check_fields(hub, "hub")


class PushFailed(RuntimeError):
    """A push that hub.push=true asked for did not happen; the run's checkpoint is kept and the message says how to
    upload it."""


def check_hub_access(hub: HubConfig, log=print) -> None:
    """Before training, with hub.push=true: the Hub answers and the token is accepted (whoami), so a run does not
    train for hours and then fail to publish. Raises PushFailed naming the endpoint, hub.repo_id and the fix."""
    from huggingface_hub import HfApi

    where = hub.endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        user = HfApi(endpoint=hub.endpoint).whoami()
    except Exception as e:  # offline, refused, a bad or missing token: all stop the run before it starts
        raise PushFailed(f"hub.push=true but the Hub at {where} cannot be used ({type(e).__name__}: "
                         f"{_redact(str(e))[:300]}). Fix: log in (`hf auth login` or HF_TOKEN), check the network "
                         f"or hub.endpoint, or train without publishing (hub.push=false) and upload later with "
                         f"`hf upload {hub.repo_id} <checkpoint>/draft`") from None
    name = user.get("name") if isinstance(user, dict) else None
    log(f"[hub] {where} reachable as {name or 'a logged-in user'}; pushes go to {hub.repo_id}")


def _redact(text: str) -> str:
    """Error messages are printed and logged: make sure no token can appear in them."""
    try:
        from huggingface_hub import get_token

        token = get_token()
    except Exception:
        token = None
    for secret in {token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")}:
        if secret:
            text = text.replace(secret, "<token>")
    return text


def _status(err: Exception) -> Optional[int]:
    resp = getattr(err, "response", None)
    return getattr(resp, "status_code", None)


def with_retries(fn: Callable[[], object], max_retries: int, backoff_s: float, log=print,
                 sleep=time.sleep) -> tuple[object, int]:
    """Call fn until it succeeds, at most 1 + max_retries times, waiting backoff_s * 2**k between tries. Returns
    (value, attempts); re-raises the last error. Client errors that retrying cannot fix are raised at once."""
    for attempt in range(1, max_retries + 2):
        try:
            return fn(), attempt
        except Exception as e:  # network errors, 5xx, timeouts: anything may be transient except NO_RETRY_STATUS
            if _status(e) in NO_RETRY_STATUS or attempt > max_retries:
                raise
            wait = backoff_s * 2 ** (attempt - 1)
            log(f"[hub] push attempt {attempt} failed ({type(e).__name__}: {_redact(str(e))[:300]}); "
                f"retrying in {wait:.0f} s")
            sleep(wait)
    raise AssertionError("unreachable")


def stage(checkpoint: Path, out: Path, card: str, kind: type[DraftAdapter], formats: tuple[str, ...],
          target_path: Optional[str], gamma: int, log=print) -> list[str]:
    """Lay out the repository in `out` from a complete checkpoint folder; returns the serving formats exported (those
    of `formats` the draft's kind exports to, drafts/registry.py: DraftKind.export)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(checkpoint / "draft", out, copy_function=_link_or_copy)
    (out / "specdistill").mkdir()
    for name in ("config.yaml", "metrics.json", "trainer_state.json"):
        if (checkpoint / name).exists():
            _link_or_copy(checkpoint / name, out / "specdistill" / name)
    exported = []
    for fmt in formats:
        if fmt in kind.spec.formats:
            try:
                kind.spec.export(checkpoint / "draft", out / "serving" / fmt, fmt=fmt, target_path=target_path,
                                 speculative_tokens=gamma)
                exported.append(fmt)
            except Exception as e:  # a failed export must not block the push of the weights
                log(f"[hub] {fmt} export skipped: {type(e).__name__}: {e}")
    (out / "README.md").write_text(card)
    return exported


def _link_or_copy(src, dst, **_):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


class HubPusher:
    """Checkpoint hook (specdistill.train.loop.fit's checkpoint_hooks): push after each epoch (hub.every_epoch) and at
    the end. Uploads run one at a time in a background thread of the main process; `finish()` waits for the last."""

    def __init__(self, cfg: Config, output_dir: Path, is_main: bool = True, log=print):
        self.cfg, self.hub = cfg, cfg.hub
        check_hub_config(self.hub)
        self.root = Path(output_dir) / "hub"
        self.is_main, self.log = is_main, log
        self.records: list[PushRecord] = []
        self._thread: Optional[threading.Thread] = None

    def __call__(self, c, saved) -> None:
        if not self.hub.push or not self.is_main or not (saved.final or self.hub.every_epoch):
            return
        self._wait()  # one upload at a time, in order
        from specdistill.drafts import draft_adapter

        # A draft with serving export formats (an EAGLE-3 head) gets them staged and a card that serves them.
        kind = type(draft_adapter(c.accelerator.unwrap_model(c.models.draft)))
        self.push(saved.path, saved.step, saved.epoch, saved.final, saved.metrics, kind, background=True)

    def push(self, checkpoint: Path, step: int, epoch: int, final: bool, metrics: dict, kind: type[DraftAdapter],
             background: bool = False) -> None:
        gamma = self.cfg.eval.gamma
        staging = self.root / f"staging-step-{step:07d}"
        formats = tuple(self.hub.serving_formats)
        exports = [f for f in formats if f in kind.spec.formats]
        card = model_card(self.cfg, self.hub.repo_id, metrics, step, epoch, kind, exports)
        exported = stage(Path(checkpoint), staging, card, kind, formats, str(self.cfg.target.path), gamma, self.log)
        if exported != exports:  # the card must only point at folders that exist
            (staging / "README.md").write_text(model_card(self.cfg, self.hub.repo_id, metrics, step, epoch, kind,
                                                          exported))
        job = lambda: self._upload(staging, step, epoch, final)  # noqa: E731
        if background:
            self._thread = threading.Thread(target=job, name=f"hub-push-{step}", daemon=True)
            self._thread.start()
        else:
            job()

    def _upload(self, staging: Path, step: int, epoch: int, final: bool) -> None:
        from huggingface_hub import HfApi

        hub, t0 = self.hub, time.perf_counter()
        api = HfApi(endpoint=hub.endpoint)  # token: HF_TOKEN or the stored login, resolved by huggingface_hub

        def attempt():
            api.create_repo(hub.repo_id, private=hub.private, exist_ok=True, repo_type="model")
            return api.upload_folder(repo_id=hub.repo_id, folder_path=str(staging), revision=hub.revision,
                                     commit_message=f"specdistill: step {step}, epoch {epoch}"
                                                    + (" (final)" if final else ""))

        try:
            info, attempts = with_retries(attempt, hub.max_retries, hub.backoff_s, self.log)
            rec = PushRecord(step, epoch, final, True, attempts, time.perf_counter() - t0,
                             commit_url=str(getattr(info, "commit_url", info)))
            shutil.rmtree(staging, ignore_errors=True)
            self.log(f"[hub] pushed step {step} to {hub.repo_id} ({rec.commit_url})")
        except Exception as e:
            rec = PushRecord(step, epoch, final, False, hub.max_retries + 1 if _status(e) not in NO_RETRY_STATUS else 1,
                             time.perf_counter() - t0, error=f"{type(e).__name__}: {_redact(str(e))[:500]}",
                             staging=str(staging))
            self.log(f"[hub] PUSH FAILED for step {step} to {hub.repo_id}: {rec.error}. The local checkpoint is "
                     f"intact; the staged folder {staging} can be uploaded with `hf upload {hub.repo_id} {staging}`")
        self.records.append(rec)
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / "push_log.jsonl").open("a") as f:
            f.write(json.dumps(asdict(rec)) + "\n")

    def _wait(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def finish(self, wait: bool = True) -> list[PushRecord]:
        """Wait for the last upload (not when preempted: a scheduler's grace period is short) and return the records."""
        if self._thread is not None:
            if wait:
                self._wait()
            else:
                self.log("[hub] an upload was still running at the stop; it is abandoned (the local checkpoint is "
                         "complete, and the next run pushes again)")
        failed = [r for r in self.records if not r.ok]
        if failed:
            self.log(f"[hub] {len(failed)} of {len(self.records)} pushes failed; see {self.root / 'push_log.jsonl'}")
        return self.records
