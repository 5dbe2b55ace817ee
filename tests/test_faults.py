"""Faults a user meets, each ending in the right behaviour or an early error that names the problem and the fix:
evaluations never overwrite results, drafts read back as trained (an export takes the target's embeddings; a head
for another target is refused by name), damaged caches are named and rebuilt, full disks and read-only folders name
the folder and the setting that moves it, and the small cases (replacement characters, a skipped tokenizer check,
replayed steps in metrics.jsonl, an unreachable Hub)."""
import errno
import json

import pytest
import torch

from specdistill.files import WriteFailed, verify_folder
from tests.conftest import compose, make_tiny_lm, make_tokenizer, tiny_overrides

QUIET = dict(log=lambda *_: None)


def _eval_cfg(tiny_target_dir, tmp_path, *extra):
    return compose(None, [f"target.path={tiny_target_dir}", "target.dtype=float32", "draft.num_layers=1",
                          f"eval.output_dir={tmp_path / 'eval'}", "eval.device=cpu", *extra])


# ------------------------------------------------------------------------------------------ results never overwritten
def test_an_evaluation_refuses_a_folder_with_results_unless_overwrite(tiny_target_dir, tmp_path, monkeypatch):
    import specdistill.eval.run as eval_run

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "results.json").write_text('{"drafter": "A"}')
    monkeypatch.setattr(eval_run, "_evaluate", lambda *a: "evaluated")
    draft = tmp_path / "kd-a" / "checkpoints" / "step-0000040" / "draft"
    draft.mkdir(parents=True)
    cfg = _eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={draft}")
    with pytest.raises(FileExistsError, match=r"results.json.*eval_kd-a-step-0000040_mt_bench_g4_t0.*"
                                              r"eval.overwrite=true"):
        eval_run.run(cfg, **QUIET)
    assert (tmp_path / "eval" / "results.json").read_text() == '{"drafter": "A"}'
    cfg.eval.overwrite = True
    assert eval_run.run(cfg, **QUIET) == "evaluated"


# ------------------------------------------------------------------------------------------ drafts read back as trained
@pytest.fixture(scope="module")
def eagle3_checkpoint(tiny_target_dir, tmp_path_factory):
    """A trained-looking EAGLE-3 checkpoint draft folder (with the run's config.yaml beside it) and its vLLM export,
    which leaves out embed_tokens."""
    from transformers import AutoModelForCausalLM

    from specdistill.drafts.eagle3.export import export_eagle3
    from specdistill.drafts.eagle3.model import build_eagle3

    root = tmp_path_factory.mktemp("eagle3")
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    head = build_eagle3(target, torch.arange(0, 200, 2), None)
    ck = root / "run" / "checkpoints" / "step-0000002"
    head.save_pretrained(ck / "draft")
    (ck / "config.yaml").write_text(f"target:\n  path: {tiny_target_dir}\n")
    export_eagle3(ck / "draft", root / "export" / "vllm", fmt="vllm", target_path=str(tiny_target_dir))
    return ck / "draft", root / "export" / "vllm"


def _target(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def test_an_export_without_embeddings_reads_back_as_its_checkpoint(eagle3_checkpoint, tiny_target_dir, tmp_path):
    from specdistill.eval.run import load_draft

    draft_dir, export_dir = eagle3_checkpoint
    assert json.loads((export_dir / "config.json").read_text())["embed_tokens_sha256"]
    target, tok = _target(tiny_target_dir), make_tokenizer()
    said = []
    from_ck = load_draft(_eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={draft_dir}"), target, tok, **QUIET)
    from_export = load_draft(_eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={export_dir}"), target, tok,
                             log=said.append)
    a, b = from_ck.state_dict(), from_export.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the embeddings included
    assert any("target's input embeddings" in s and "digest matches" in s for s in said)


def test_a_warm_start_from_an_export_takes_the_targets_embeddings(eagle3_checkpoint, tiny_target_dir):
    from types import SimpleNamespace

    from specdistill.drafts.eagle3.adapter import build_eagle3_draft
    from specdistill.models.target import Target

    draft_dir, export_dir = eagle3_checkpoint
    target = _target(tiny_target_dir)
    head = build_eagle3_draft(SimpleNamespace(path=str(export_dir), intermediate_size=None), Target(target), None)
    trained = build_eagle3_draft(SimpleNamespace(path=str(draft_dir), intermediate_size=None), Target(target), None)
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in head.state_dict().items())


def test_a_speculators_export_is_refused_by_name(eagle3_checkpoint, tiny_target_dir, tmp_path):
    from specdistill.eval.run import load_draft
    from specdistill.drafts.eagle3.export import export_eagle3

    out = tmp_path / "speculators"
    export_eagle3(eagle3_checkpoint[0], out, fmt="speculators", target_path=str(tiny_target_dir))
    with pytest.raises(ValueError, match="speculators-format export.*--format vllm"):
        load_draft(_eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={out}"), _target(tiny_target_dir),
                   make_tokenizer(), **QUIET)


def test_an_export_is_refused_with_another_targets_embeddings(eagle3_checkpoint, tiny_target_dir, tmp_path):
    from specdistill.eval.run import load_draft

    _, export_dir = eagle3_checkpoint
    other = make_tiny_lm(len(make_tokenizer()), seed=7)  # the same shapes, other weights
    with pytest.raises(ValueError, match=rf"digest.*trained for {tiny_target_dir}"):
        load_draft(_eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={export_dir}"), other, make_tokenizer(),
                   **QUIET)


@pytest.mark.parametrize("which", ["checkpoint", "export"])
def test_a_head_for_another_target_is_refused_by_name_before_decoding(which, eagle3_checkpoint, tiny_target_dir,
                                                                      tmp_path):
    from specdistill.eval.run import load_draft

    folder = eagle3_checkpoint[0 if which == "checkpoint" else 1]
    wider = make_tiny_lm(len(make_tokenizer()), hidden=32)
    with pytest.raises(ValueError, match=rf"does not fit the target.*width 64.*hidden size is 32.*trained for "
                                         rf"{tiny_target_dir}"):
        load_draft(_eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={folder}"), wider, make_tokenizer(),
                   **QUIET)


def test_a_dflash_draft_for_another_target_is_refused_by_name_before_decoding(tiny_target_dir, tmp_path):
    from specdistill.drafts.dflash.model import build_dflash
    from specdistill.eval.run import load_draft

    ck = tmp_path / "ck"
    build_dflash(_target(tiny_target_dir), num_layers=1, block_size=4, target_layer_ids=None,
                 mask_token_id=0).save_pretrained(ck / "draft")
    (ck / "config.yaml").write_text(f"target:\n  path: {tiny_target_dir}\n")
    deeper = make_tiny_lm(len(make_tokenizer()), layers=6)
    with pytest.raises(ValueError, match=rf"does not fit.*4-layer target.*has 6 layers.*trained for {tiny_target_dir}"):
        load_draft(_eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={ck / 'draft'}"), deeper,
                   make_tokenizer(), **QUIET)


def test_an_lm_draft_for_another_vocabulary_names_the_target_it_was_trained_for(tiny_target_dir, tmp_path):
    from specdistill.eval.run import load_draft

    ck = tmp_path / "ck"
    make_tiny_lm(len(make_tokenizer()) + 16, layers=1).save_pretrained(ck / "draft")
    (ck / "config.yaml").write_text("target:\n  path: /models/another-target\n")
    said = []
    with pytest.raises(ValueError, match="vocab size.*trained for /models/another-target"):
        load_draft(_eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={ck / 'draft'}"), _target(tiny_target_dir),
                   make_tokenizer(), log=said.append)


def test_a_draft_without_a_tokenizer_says_the_check_is_skipped(tiny_target_dir, tmp_path):
    from specdistill.eval.run import load_draft

    d = tmp_path / "ck" / "draft"
    make_tiny_lm(len(make_tokenizer()), layers=1).save_pretrained(d)
    said = []
    load_draft(_eval_cfg(tiny_target_dir, tmp_path, f"eval.draft_path={d}"), _target(tiny_target_dir),
               make_tokenizer(), log=said.append)
    assert any("tokenizer check is skipped" in s for s in said)


# ------------------------------------------------------------------------------------------ caches and disks
def _data_cfg(tiny_data_file, cache_dir, path=None):
    from specdistill.config import DataConfig

    return DataConfig(path=str(path or tiny_data_file), max_length=64, heldout_size=8, cache_dir=str(cache_dir))


def test_a_truncated_data_cache_file_is_named_and_rebuilt(tiny_data_file, tmp_path):
    from specdistill.data.dataset import build_data

    tok = make_tokenizer()
    first = build_data(_data_cfg(tiny_data_file, tmp_path), tok, **QUIET)
    arrow = next((tmp_path / first.fingerprint / "train").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    said = []
    again = build_data(_data_cfg(tiny_data_file, tmp_path), tok, log=said.append)
    assert any(str(arrow) in s and "will be rebuilt" in s for s in said), said
    assert again.train["input_ids"] == first.train["input_ids"]
    assert verify_folder(tmp_path / first.fingerprint) == []  # the rebuilt cache is whole


def test_a_full_disk_while_caching_data_names_the_folder_and_the_setting(tiny_data_file, tmp_path, monkeypatch):
    import datasets

    from specdistill.data.dataset import build_data

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full)
    with pytest.raises(WriteFailed, match=rf"{tmp_path}.*no space left.*data.cache_dir"):
        build_data(_data_cfg(tiny_data_file, tmp_path / "cache"), make_tokenizer(), **QUIET)
    assert not [p for p in (tmp_path / "cache").iterdir()]  # no partial cache left behind


def test_a_full_disk_while_checkpointing_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from accelerate import Accelerator

    import specdistill.train.checkpoint as ckpt

    acc, draft = Accelerator(cpu=True), make_tiny_lm(64, layers=1, hidden=16)
    state = {"step": 1, "tokens_seen": 0}
    first = ckpt.save_checkpoint(acc, draft, None, tmp_path, 1, state, {}, "a: 1")

    def full(folder):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")  # torch on ENOSPC

    monkeypatch.setattr(ckpt, "write_manifest", full)
    with pytest.raises(WriteFailed, match=rf"{tmp_path / 'checkpoints'}.*full disk.*{first}.*kept.*"
                                          r"trainer.output_dir="):
        ckpt.save_checkpoint(acc, draft, None, tmp_path, 2, {**state, "step": 2}, {}, "a: 1")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]


def test_folders_that_are_not_writable_are_refused_before_any_work(tiny_target_dir, tiny_data_file, tmp_path,
                                                                   monkeypatch):
    import specdistill.pipeline.run as pipeline

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(pipeline, "assemble", lambda *a, **k: pytest.fail("built before the folders were checked"))
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "out", blocker / "cache"))
    with pytest.raises(WriteFailed, match=rf"{blocker / 'cache'} is not writable.*data.cache_dir="):
        pipeline.run(cfg)


# ------------------------------------------------------------------------------------------ the small cases
def test_replacement_characters_in_the_data_are_counted_and_reported(tmp_path):
    from specdistill.data.dataset import build_data

    rows = [{"conversations": [{"from": "human", "value": "hello the cat"}, {"from": "gpt", "value": "B" * 3}]}] * 30
    lines = [json.dumps(r).encode() for r in rows]
    lines[3] = lines[3].replace(b"hello", b"hel\xff\xfelo")  # two bytes that are not UTF-8
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\n".join(lines))
    said = []
    out = build_data(_data_cfg(None, tmp_path / "cache", data), make_tokenizer(), log=said.append)
    assert out.report["replacement_characters"] == 2 and out.report["rows_with_replacement_characters"] == 1
    assert any("2 replacement characters" in s and "1 conversations" in s for s in said)


def test_metrics_jsonl_holds_each_step_once_after_a_kill_and_resume(tiny_target_dir, tiny_data_file, tmp_path):
    import shutil

    from specdistill.build import build
    from specdistill.train.loop import fit

    over = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "out", tmp_path / "cache") + [
        "trainer.max_steps=3", "trainer.save_every=2", "trainer.keep_checkpoints=3", "trainer.measure_roofline=false"]
    log = tmp_path / "out" / "metrics.jsonl"

    def steps():
        return [(r["step"], sorted(r)) for r in map(json.loads, log.read_text().splitlines())]

    fit(build(compose("kd", over)))
    whole = steps()
    assert {s for s, _ in whole} == {1, 2, 3}
    shutil.rmtree(tmp_path / "out" / "checkpoints" / "step-0000003")  # killed after logging step 3, before its save
    fit(build(compose("kd", over + ["trainer.resume=auto"])))
    assert steps() == whole  # step 3 replayed: its lines replace the first copies


def test_an_unreachable_hub_stops_a_push_run_before_training(tiny_target_dir, tiny_data_file, tmp_path, monkeypatch):
    import huggingface_hub

    import specdistill.pipeline.run as pipeline
    from specdistill.hub.push import PushFailed

    def offline(self, *a, **k):
        raise ConnectionError("cannot reach the server")

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", offline)
    monkeypatch.setattr(pipeline, "assemble", lambda *a, **k: pytest.fail("built although the Hub is unreachable"))
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "out", tmp_path / "cache")
                  + ["hub.push=true", "hub.repo_id=me/draft", "hub.max_retries=0"])
    with pytest.raises(PushFailed, match="hub.push=true.*cannot be used.*hub.push=false"):
        pipeline.run(cfg)


def test_a_failed_push_fails_the_run_and_keeps_the_checkpoint(tiny_target_dir, tiny_data_file, tmp_path, monkeypatch):
    import huggingface_hub

    import specdistill.pipeline.run as pipeline
    from specdistill.hub.push import PushFailed

    def refused(self, *a, **k):
        raise ConnectionError("the upload was cut")

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda self, *a, **k: {"name": "me"})
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", refused)
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "out", tmp_path / "cache")
                  + ["trainer.max_steps=2", "hub.push=true", "hub.repo_id=me/draft", "hub.max_retries=0"])
    with pytest.raises(PushFailed, match=r"1 of 1 pushes.*checkpoint .*step-0000002 is kept.*hf upload"):
        pipeline.run(cfg)
    assert (tmp_path / "out" / "checkpoints" / "step-0000002" / "draft" / "model.safetensors").exists()

    pushed = []  # the Hub is back: a resume of the trained run pushes its final checkpoint, and only that
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **k: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **k: pushed.append(k) or "url")
    cfg.trainer.resume = "auto"
    res = pipeline.run(cfg)
    assert res.nothing_to_do and len(pushed) == 1 and "step 2" in pushed[0]["commit_message"]
    assert "hub/push" in pipeline.read_stages(tmp_path / "out")


def test_a_truncated_converted_model_in_the_cache_is_named_and_converted_again(tmp_path, monkeypatch, capsys):
    import specdistill.assets as assets
    from safetensors.torch import save_file

    name = "smollm2-135m-instruct"
    package, pip_name, gguf = assets.EMBEDDED_MODELS[name]
    try:
        src = assets._package_dir(package, pip_name)
    except FileNotFoundError:
        pytest.skip(f"{pip_name} is not installed")
    out = tmp_path / "models" / name
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    save_file({"w": torch.zeros(64, 64)}, str(out / "model.safetensors"))
    whole = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    (out / "converted_from.json").write_text(json.dumps(
        {"gguf": gguf, "sha256": assets.file_digest(src / gguf), "converter": assets.CONVERTER_VERSION}))
    converted = []
    monkeypatch.setattr(assets, "CACHE_ROOT", tmp_path)
    monkeypatch.setattr(assets, "_convert_gguf", lambda *a: converted.append(a))
    assert assets.resolve_model_path(f"embedded:{name}") == str(out)
    said = capsys.readouterr().out
    assert converted and f"{out / 'model.safetensors'} is damaged (truncated" in said and "converted again" in said


def test_an_export_to_a_full_disk_names_the_folder_and_exits_non_zero(eagle3_checkpoint, tmp_path, monkeypatch,
                                                                     capsys):
    import safetensors.torch

    from specdistill.cli.export import main

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["--draft", str(eagle3_checkpoint[0]), "--out", str(tmp_path / "x" / "vllm")]) == 2
    err = capsys.readouterr().err
    assert f"could not write to {tmp_path / 'x'}: no space left" in err and "--out=<another folder>" in err
    assert not (tmp_path / "x" / "vllm").exists()


def test_a_truncated_regenerated_part_is_named_and_made_again(tiny_data_file, tmp_path):
    from specdistill.config import RegenerateConfig
    from specdistill.data.regenerated import RegeneratedStore, part_path
    from specdistill.pipeline.regenerate import regenerate_store

    tok = make_tokenizer()
    model = make_tiny_lm(len(tok), layers=4).eval()
    cfg = RegenerateConfig(enabled=True, prompts=str(tiny_data_file), max_prompts=8, max_new_tokens=6, batch_size=4,
                           store_dir=str(tmp_path / "store"))
    root, parts = regenerate_store(cfg, model, tok, "tiny", [1, 2, 3], **QUIET, progress=False)
    part = part_path(root, 1)
    whole = part.read_bytes()
    part.write_bytes(whole[: len(whole) // 2])
    said = []
    root2, parts2 = regenerate_store(cfg, model, tok, "tiny", [1, 2, 3], log=said.append, progress=False)
    assert (root2, parts2) == (root, parts)
    assert any(f"{part} is damaged (truncated" in s and "made again" in s for s in said), said
    assert part.read_bytes() == whole and len(RegeneratedStore(root, parts)) == 8


def test_replacement_characters_in_evaluation_prompts_are_counted(tmp_path):
    from specdistill.data.prompts import load_prompts

    rows = [json.dumps({"prompt": "what is the cat"}).encode() for _ in range(3)]
    rows[1] = rows[1].replace(b"cat", b"c\xffat")
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(b"\n".join(rows))
    ps = load_prompts(str(f), make_tokenizer(), num_prompts=None, max_new_tokens=4)
    assert len(ps) == 3 and ps.replacement_chars == 1


def test_a_full_disk_while_logging_names_the_output_folder_and_the_kept_checkpoint(tiny_target_dir, tiny_data_file,
                                                                                   tmp_path, monkeypatch):
    import specdistill.pipeline.run as pipeline
    import specdistill.train.loop as loop

    real_log, calls = loop._log, []

    def log_until_full(acc, metrics, step, path):
        calls.append(step)
        if step == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_log(acc, metrics, step, path)

    monkeypatch.setattr(loop, "_log", log_until_full)
    out = tmp_path / "out"
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache")
                  + ["trainer.max_steps=4", "trainer.save_every=2"])
    with pytest.raises(WriteFailed, match=rf"{out}: no space left.*step-0000002 is kept.*trainer.output_dir="):
        pipeline.run(cfg)
