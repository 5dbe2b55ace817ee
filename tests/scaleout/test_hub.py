"""Hub push against a loopback HTTP server that implements the Hub calls huggingface_hub makes for create_repo and
upload_folder (repo create, preupload, commit, YAML validation): the draft, the card and the EAGLE-3 serving exports
arrive; a failing server is retried with backoff, then reported without touching the local checkpoint; the token is
sent to the server and printed or written nowhere."""
import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specdistill.drafts import LMDraft
from specdistill.hub.card import model_card
from specdistill.hub.push import HubPusher, with_retries
from specdistill.entry import load_config
from tests.conftest import compose, tiny_overrides

TOKEN = "hf_loopbackSecretToken0123456789"


class FakeHub:
    """A Hub with one revision per repo: files[repo][path] = bytes. fail_commits > 0 answers that many commits with
    409 (a concurrent commit: transient, and not retried by huggingface_hub itself, which retries 5xx on its own)."""

    def __init__(self, fail_commits: int = 0):
        self.files: dict[str, dict[str, bytes]] = {}
        self.commits: list[dict] = []
        self.auth: set[str] = set()
        self.unknown: list[str] = []
        self.fail_commits = fail_commits
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def _send(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                hub.auth.add(self.headers.get("authorization", ""))
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] == ["api", "repos", "create"]:
                    req = json.loads(body)
                    repo = f"{req.get('organization') or 'user'}/{req['name']}"
                    hub.files.setdefault(repo, {})
                    return self._send(200, {"url": f"{hub.url}/{repo}", "name": repo})
                if parts[:2] == ["api", "validate-yaml"]:
                    return self._send(200, {"errors": [], "warnings": []})
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "commit":
                    if hub.fail_commits > 0:
                        hub.fail_commits -= 1
                        return self._send(409, {"error": "injected failure: a concurrent commit"})
                    repo = f"{parts[2]}/{parts[3]}"
                    msg = None
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "header":
                            msg = item["value"]["summary"]
                        elif item["key"] == "file":
                            v = item["value"]
                            hub.files.setdefault(repo, {})[v["path"]] = base64.b64decode(v["content"])
                    hub.commits.append({"repo": repo, "message": msg})
                    oid = f"{len(hub.commits):040x}"
                    return self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                                            "success": True})
                hub.unknown.append(f"POST {self.path}")
                return self._send(404, {"error": f"not implemented: {self.path}"})

            def do_GET(self):
                if self.path.split("?")[0] == "/api/whoami-v2":  # the access check before training
                    hub.auth.add(self.headers.get("authorization", ""))
                    return self._send(200, {"name": "me", "type": "user"})
                hub.unknown.append(f"GET {self.path}")
                return self._send(404, {"error": f"not implemented: {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub_env(monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)  # tests/conftest.py sets offline mode for everything else
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def _no_token_anywhere(root: Path, captured: str):
    assert TOKEN not in captured
    for f in root.rglob("*"):
        if f.is_file():
            assert TOKEN.encode() not in f.read_bytes(), f


def test_training_pushes_each_epoch_and_the_end_with_card_and_eagle3_exports(tiny_target_dir, tiny_data_file,
                                                                              tmp_path, hub_env, capfd):
    from specdistill.pipeline.run import run

    out = tmp_path / "out"
    with FakeHub(fail_commits=1) as hub:  # the first commit fails once: retried after the backoff
        cfg = compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + [
            "trainer.micro_batch_size=8", "trainer.grad_accum=2", "trainer.max_steps=6",  # 5 steps per epoch
            "eval.spec_eval=true", "eval.prompts=heldout", "eval.warmup_prompts=0", "eval.measure_cost=false",
            "hub.push=true", "hub.repo_id=me/tiny-eagle3", f"hub.endpoint={hub.url}", "hub.backoff_s=0.05"])
        res = run(cfg)
    assert res.step == 6 and not hub.unknown, hub.unknown
    assert [c["message"] for c in hub.commits] == ["specdistill: step 5, epoch 0",
                                                   "specdistill: step 6, epoch 1 (final)"]
    files = hub.files["me/tiny-eagle3"]
    for f in ("config.json", "model.safetensors", "README.md", "specdistill/config.yaml", "specdistill/metrics.json",
              "serving/vllm/config.json", "serving/vllm/model.safetensors", "serving/sglang/config.json"):
        assert f in files, (f, sorted(files))
    card = files["README.md"].decode()
    assert "mean acceptance length tau" in card and "draft/serving/vllm" in card and "EAGLE3" in card
    # the local checkpoint is the one pushed
    assert files["model.safetensors"] == (res.final_checkpoint / "draft" / "model.safetensors").read_bytes()
    log = [json.loads(line) for line in (out / "hub" / "push_log.jsonl").read_text().splitlines()]
    assert [(r["ok"], r["attempts"]) for r in log] == [(True, 2), (True, 1)]
    assert not list((out / "hub").glob("staging-*"))  # removed after a successful upload
    assert f"Bearer {TOKEN}" in hub.auth  # the token went to the server, and nowhere else
    captured = capfd.readouterr()
    _no_token_anywhere(out, captured.out + captured.err)


def test_a_failing_hub_is_retried_then_reported_and_the_checkpoint_is_kept(tiny_target_dir, tiny_data_file,
                                                                           tmp_path, hub_env, capfd):
    ckpt = tmp_path / "out" / "checkpoints" / "step-0000003"
    (ckpt / "draft").mkdir(parents=True)
    (ckpt / "draft" / "config.json").write_text('{"model_type": "llama"}')
    (ckpt / "draft" / "model.safetensors").write_bytes(b"weights")
    (ckpt / "trainer_state.json").write_text('{"step": 3}')
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    with FakeHub(fail_commits=100) as hub:
        cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "out", tmp_path / "cache") + [
            "hub.push=true", "hub.repo_id=me/tiny", f"hub.endpoint={hub.url}", "hub.max_retries=2",
            "hub.backoff_s=0.01"])
        pusher = HubPusher(load_config(cfg, log=None), tmp_path / "out")
        pusher.push(ckpt, step=3, epoch=0, final=True, metrics={}, kind=LMDraft)
        records = pusher.finish()
    assert len(hub.commits) == 0 and hub.fail_commits == 100 - 3  # 1 try + 2 retries
    assert len(records) == 1 and not records[0].ok and records[0].attempts == 3 and "409" in records[0].error
    assert Path(records[0].staging, "model.safetensors").read_bytes() == b"weights"  # kept for a manual upload
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    captured = capfd.readouterr()
    assert "PUSH FAILED" in captured.out + captured.err
    _no_token_anywhere(tmp_path / "out", captured.out + captured.err)


def test_retries_are_bounded_with_exponential_backoff():
    waits, calls = [], []

    def flaky():
        calls.append(1)
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        with_retries(flaky, max_retries=3, backoff_s=2.0, log=lambda m: None, sleep=waits.append)
    assert len(calls) == 4 and waits == [2.0, 4.0, 8.0]


def test_card_for_a_standalone_draft_has_the_tau_table_and_serving_commands(tiny_target_dir, tiny_data_file, tmp_path):
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path, tmp_path / "cache"))
    metrics = {"spec/mean_accept_len": 2.5, "spec/alpha": 0.6, "spec/speedup": 1.7, "spec/num_prompts": 8.0,
               "spec/accept_rate_pos1": 0.8, "spec/accept_rate_pos2": 0.6, "heldout/mean_accept_len": 2.2}
    card = model_card(load_config(cfg, log=None), "me/draft", metrics, step=40, epoch=1, kind=LMDraft)
    assert card.startswith("---\nlibrary_name: transformers") and "| mean acceptance length tau" in card
    assert "| acceptance | 0.800 | 0.600 |" in card and "tau 2.200" in card
    assert '"model": "me/draft"' in card and "--speculative-algorithm STANDALONE" in card
    assert str(tiny_target_dir) in card and '"name": "kd"' in card


def test_push_true_without_a_repo_fails_before_loading_anything(tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.pipeline.run import run

    cfg = compose("kd", tiny_overrides(tmp_path / "missing", tiny_data_file, tmp_path, tmp_path / "c")
                  + ["hub.push=true"])
    with pytest.raises(ValueError, match="hub.repo_id"):
        run(cfg)
