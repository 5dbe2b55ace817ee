"""A resume notices what changed under it: inputs edited in place (even to the same size and modification time), a
folder that holds another run's files, a checkpoint evaluated with another target, a store part or feature shard
damaged in place, a stage's output deleted, and other eval settings on a finished run."""
import json
import os
import shutil

import pytest
import torch
from omegaconf import OmegaConf

import specdistill.pipeline.run as pipeline
from specdistill.entry import config_yaml
from specdistill.train.inputs import InputsChanged, read_inputs
from specdistill.entry import load_config
from tests.conftest import compose, make_tiny_lm, make_tokenizer, tiny_overrides

EVAL = ["eval.spec_eval=true", "eval.spec_eval_at=end", "eval.num_prompts=2", "eval.max_new_tokens=6", "eval.gamma=2",
        "eval.warmup_prompts=0", "eval.measure_cost=false", "trainer.export_formats=[]"]


class Reached(BaseException):
    """Raised in place of training: the run got past every check before it."""


@pytest.fixture(scope="module")
def run(tiny_target_dir, tiny_data_file, tmp_path_factory):
    """A finished run (2 steps, final evaluation) on its own copies of the target and the data, which tests edit and
    put back."""
    root = tmp_path_factory.mktemp("inputs")
    target, data = root / "target", root / "conv.jsonl"
    shutil.copytree(tiny_target_dir, target)
    shutil.copy(tiny_data_file, data)

    def cfg(*extra, out="run"):
        return compose("eagle3", tiny_overrides(target, data, root / out, root / "cache")
                       + ["trainer.max_steps=2", f"eval.prompts={data}", *EVAL, *extra])

    pipeline.run(cfg())
    return {"root": root, "out": root / "run", "target": target, "data": data, "cfg": cfg}


def trainer(composed):
    """The trainer settings a folder claim reads, typed as the entry makes them (the rest of `composed` unchecked)."""
    return OmegaConf.to_object(composed.trainer)


def _checkpoint(out):
    return sorted((out / "checkpoints").glob("step-*"))[-1]


def _same_size_edit(path):
    """Change one word of `path` to another of the same length, keeping its size and modification time."""
    before = path.stat()
    text = path.read_text()
    edited = text.replace('"cat', '"dog', 1) if '"cat' in text else text.replace('"dog', '"cat', 1)
    assert edited != text and len(edited) == len(text)
    path.write_text(edited)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    return text


def test_a_checkpoint_records_its_inputs_by_content(run):
    rec = read_inputs(_checkpoint(run["out"]))
    assert rec["data_path"] == str(run["data"]) and rec["target_path"] == str(run["target"])
    for key in ("data_bytes", "target_files", "target_embeddings", "tokenizer", "chat_template"):
        assert rec[key], key
    manifest = json.loads((_checkpoint(run["out"]) / "manifest.json").read_text())["files"]
    assert "inputs.json" in manifest  # verified with the rest of the checkpoint


def test_only_inputs_changed_in_place_are_input_changes():
    """An input the config names differently (another data.path, target.path or data.chat_template) is the config
    comparison's to report (and refuse unless trainer.resume_allow_drift); the same name with other content is this
    check's."""
    from specdistill.train.inputs import input_changes

    rec = {"data_path": "a.jsonl", "data_bytes": "sha256:1", "target_path": "t", "target_files": "sha256:2",
           "target_embeddings": "e1", "tokenizer": "k1", "chat_template": "c1", "chat_template_setting": None}
    assert input_changes(rec, dict(rec)) == []
    assert [c.key for c in input_changes(rec, {**rec, "data_bytes": "sha256:9"})] == ["data_bytes"]
    assert input_changes(rec, {**rec, "data_path": "b.jsonl", "data_bytes": "sha256:9"}) == []
    assert input_changes(rec, {**rec, "target_path": "u", "target_files": "sha256:9", "target_embeddings": "e2"}) == []
    templated = {**rec, "chat_template_setting": "x.jinja", "tokenizer": "k2", "chat_template": "c2"}
    assert input_changes(rec, templated) == []
    assert [c.key for c in input_changes(rec, {**rec, "tokenizer": "k2", "chat_template": "c2"})] == [
        "tokenizer", "chat_template"]


def test_a_resume_over_data_edited_in_place_is_refused_by_name(run, monkeypatch):
    data = run["data"]
    original = _same_size_edit(data)
    try:
        with pytest.raises(InputsChanged) as e:
            pipeline.run(run["cfg"]("trainer.resume=auto", "trainer.max_steps=4"))
        msg = str(e.value)
        assert f"data.path={data}" in msg and "its bytes" in msg
        assert "trainer.resume_accept_changed_inputs=true" in msg and "another trainer.output_dir" in msg
        assert "target.path" not in msg  # only what changed is named

        def reached(*a, **k):
            raise Reached()

        monkeypatch.setattr(pipeline, "fit", reached)
        with pytest.raises(Reached):  # accepted on purpose: past the check
            pipeline.run(run["cfg"]("trainer.resume=auto", "trainer.max_steps=4",
                                    "trainer.resume_accept_changed_inputs=true"))
    finally:
        data.write_text(original)


def test_a_resume_over_new_weights_in_the_target_folder_is_refused_by_name(run, tiny_target_dir):
    weights = run["target"] / "model.safetensors"
    original = weights.read_bytes()
    make_tiny_lm(len(make_tokenizer()), seed=1).save_pretrained(run["target"])  # same shapes, other weights
    try:
        with pytest.raises(InputsChanged) as e:
            pipeline.run(run["cfg"]("trainer.resume=auto", "trainer.max_steps=4"))
        msg = str(e.value)
        assert f"target.path={run['target']}: its files" in msg
        assert f"target.path={run['target']}: its input embeddings" in msg
        assert "data.path" not in msg
    finally:
        weights.write_bytes(original)


def test_evaluation_refuses_a_checkpoint_trained_for_another_target(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdistill.eval.run import load_draft

    other = tmp_path / "other_target"
    make_tiny_lm(len(make_tokenizer()), seed=1).save_pretrained(other)  # the same shapes, other weights
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (run["target"] / f).exists():
            shutil.copy(run["target"] / f, other / f)
    draft_dir = _checkpoint(run["out"]) / "draft"

    def evaluate_with(target_dir):
        cfg = run["cfg"](f"target.path={target_dir}", f"eval.draft_path={draft_dir}")
        model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32)
        return load_draft(cfg, model, AutoTokenizer.from_pretrained(target_dir), log=lambda *_: None)

    with pytest.raises(ValueError) as e:
        evaluate_with(other)
    msg = str(e.value)
    assert str(draft_dir) in msg and f"it was trained for {run['target']}" in msg and "input embeddings" in msg
    assert evaluate_with(run["target"]) is not None  # its own target: accepted

    # the draft folder copied out of its checkpoint still names its target and the digest of its embeddings
    draft_dir = tmp_path / "copied_draft"
    shutil.copytree(_checkpoint(run["out"]) / "draft", draft_dir)
    with pytest.raises(ValueError) as e:
        evaluate_with(other)
    msg = str(e.value)
    assert str(draft_dir) in msg and f"it was trained for {run['target']}" in msg and "input embeddings" in msg
    assert evaluate_with(run["target"]) is not None


def test_a_draft_folder_with_no_record_of_its_target_says_it_cannot_be_checked(tmp_path):
    from specdistill.drafts.readback import check_trained_target

    (tmp_path / "config.json").write_text("{}")
    said = []
    check_trained_target(tmp_path, make_tiny_lm(len(make_tokenizer())), log=said.append)
    assert len(said) == 1 and "cannot check which target" in said[0] and str(tmp_path) in said[0]


def test_a_fresh_run_into_another_runs_folder_is_refused_without_a_checkpoint(run, tmp_path):
    out = tmp_path / "killed"  # a run killed at step 30 of 1000, before its first checkpoint
    out.mkdir()
    (out / "config.yaml").write_text((run["out"] / "config.yaml").read_text())
    (out / "metrics.jsonl").write_text('{"step": 30, "train/loss": 1.0}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    cfg = compose("eagle3", tiny_overrides(run["target"], run["data"], out, run["root"] / "cache")
                  + ["trainer.max_steps=2", *EVAL])
    with pytest.raises(FileExistsError) as e:
        pipeline.run(cfg)
    msg = str(e.value)
    assert str(out / "config.yaml") in msg and str(out / "metrics.jsonl") in msg
    assert "another trainer.output_dir" in msg and "start it over with trainer.resume=auto" in msg
    assert f"its files are moved to {out / 'earlier-'}" in msg
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before

    # resume=auto into a folder of another run's settings, no checkpoint: refused too; of its own: started over
    other = compose("eagle3", tiny_overrides(run["target"], run["data"], out, run["root"] / "cache")
                    + ["trainer.max_steps=2", "draft.num_layers=2", "trainer.resume=auto", *EVAL])
    with pytest.raises(FileExistsError, match="draft.num_layers"):
        pipeline.check_folder_claim(trainer(other), config_yaml(other), out)
    said = []
    (out / "config.yaml").write_text(config_yaml(cfg))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    own = compose("eagle3", tiny_overrides(run["target"], run["data"], out, run["root"] / "cache")
                  + ["trainer.max_steps=2", "trainer.resume=auto", *EVAL])
    aside = pipeline.check_folder_claim(trainer(own), config_yaml(own), out, log=said.append)
    assert "starts over at step 0" in said[0] and str(out / "metrics.jsonl") in said[0] and str(aside) in said[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # checking moves nothing

    # starting it over keeps the earlier run's files, moved aside whole; the new run writes its own
    pipeline.run(own)
    moved = sorted(out.glob("earlier-*"))
    assert len(moved) == 1 and {p.name: p.read_bytes() for p in moved[0].iterdir()} == before
    assert (out / "metrics.jsonl").read_bytes() != before["metrics.jsonl"] and _checkpoint(out).exists()


def test_a_deleted_stage_output_is_made_again_and_other_eval_settings_evaluate_into_a_new_folder(run, monkeypatch):
    out = run["out"]
    final = out / "eval" / "final"
    (final / "results.json").unlink()  # the folder stays: its files are what is checked
    assert "results.json is missing" in pipeline.why_pending(load_config(run["cfg"]()), out, 2)["eval/final"]
    res = pipeline.run(run["cfg"]("trainer.resume=auto"))
    assert res.nothing_to_do and (final / "results.json").exists()
    assert pipeline.why_pending(load_config(run["cfg"]()), out, 2) == {}

    stamps = {p: p.stat().st_mtime_ns for p in final.rglob("*") if p.is_file()}
    other = run["cfg"]("trainer.resume=auto", "eval.gamma=3")
    pending = pipeline.why_pending(load_config(other), out, 2)
    (name, why), = pending.items()
    assert name.startswith("eval/final-") and "eval.gamma: 2 -> 3" in why
    pipeline.run(other)
    made = out / name
    assert json.loads((made / "results.json").read_text())["gamma"] == 3
    assert {p: p.stat().st_mtime_ns for p in final.rglob("*") if p.is_file()} == stamps  # eval/final untouched
    assert pipeline.read_stages(out)[name]["settings"]["gamma"] == 3

    def must_not_run(*a, **k):
        raise AssertionError("an evaluation that is complete ran again")

    monkeypatch.setattr(pipeline, "run_spec_eval", must_not_run)
    monkeypatch.setattr(pipeline, "final_spec_eval", must_not_run)
    assert pipeline.run(other).nothing_to_do  # made once
    assert pipeline.run(run["cfg"]("trainer.resume=auto")).nothing_to_do  # eval/final's own settings: nothing


def test_other_eval_settings_on_a_run_evaluated_at_each_epoch_ask_for_their_own_evaluation(run, tmp_path):
    """eval.spec_eval_at=every_epoch (no eval/final stage): the settings compared are the checkpoint's config's."""
    every = ["eval.spec_eval_at=every_epoch"]
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"step": 2}')
    (ckpt / "config.yaml").write_text(config_yaml(run["cfg"](*every)))
    out = ckpt.parent.parent
    assert pipeline.why_pending(load_config(run["cfg"](*every)), out, 2) == {}
    assert pipeline.why_pending(load_config(run["cfg"](*every, "eval.spec_eval=false", "eval.gamma=3")), out, 2) == {}
    (name, why), = pipeline.why_pending(load_config(run["cfg"](*every, "eval.gamma=3")), out, 2).items()
    assert name.startswith("eval/final-") and "eval.gamma: 2 -> 3" in why and str(out / name) in why


def _damage_in_place(path, offset_from_end=64):
    """Overwrite bytes near the end of `path` (tensor data) with large float bits, keeping its size and mtime."""
    before = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end:-offset_from_end + 16] = b"\x7f\x6f" * 8
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size


def test_a_store_part_damaged_in_place_is_named_and_made_again(tiny_data_file, tmp_path):
    from specdistill.config import RegenerateConfig
    from specdistill.data.regenerated import checksum_path, part_path
    from specdistill.files import sha256
    from specdistill.pipeline.regenerate import regenerate_store

    torch.manual_seed(0)
    tok = make_tokenizer()
    model = make_tiny_lm(len(tok), layers=2).eval()
    cfg = RegenerateConfig(enabled=True, prompts=str(tiny_data_file), max_prompts=8, max_new_tokens=6, batch_size=4,
                           store_dir=str(tmp_path / "store"))
    root, parts = regenerate_store(cfg, model, tok, "tiny", [1], log=lambda *_: None, progress=False)
    part = part_path(root, 1)
    good = sha256(part)
    assert checksum_path(part).read_text().strip() == good
    _damage_in_place(part)
    said = []
    regenerate_store(cfg, model, tok, "tiny", [1], log=said.append, progress=False)
    assert any(str(part) in line and "SHA-256" in line for line in said), said
    assert sha256(part) == good  # made again: the same greedy answers and features


def test_a_feature_shard_damaged_in_place_is_refused_by_name(tmp_path):
    from specdistill.data.features import FeatureStore, FeatureWriter

    w = FeatureWriter(tmp_path / "features", {"v": 1})
    for n in (5, 7):
        w.add(torch.randn(n, 6), torch.randn(n, 4))
    root = w.close()
    assert len(FeatureStore(root)) == 2
    _damage_in_place(root / "shard-00000.safetensors", offset_from_end=24)
    with pytest.raises(ValueError, match="shard-00000.safetensors: its SHA-256 differs"):
        FeatureStore(root)
