"""Checkpoints record sizes + checksums; resume verifies the newest, moves a corrupt one aside and falls back;
evaluate / export refuse a corrupt draft by name; a finished run re-run leaves every result file byte-identical;
exports and checkpoints follow the umask."""
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from specdistill.build import build
from specdistill.train.checkpoint import list_checkpoints
from specdistill.files import MANIFEST, CorruptCheckpoint, verify_folder
from specdistill.train.loop import fit
from tests.conftest import compose, make_tiny_lm, tiny_overrides

COMMON = ["trainer.max_steps=6", "trainer.save_every=3", "trainer.keep_checkpoints=5", "trainer.lr=5e-3"]


def _cfg(target, data, out, cache, extra=()):
    return compose("kd", tiny_overrides(target, data, out, cache) + COMMON + list(extra))


def _params(c):
    return {k: v.detach().clone() for k, v in c.accelerator.unwrap_model(c.models.draft).state_dict().items()}


@pytest.fixture(scope="module")
def finished(tiny_target_dir, tiny_data_file, tmp_path_factory):
    """A finished 6-step run with checkpoints at steps 3 and 6, and its final weights."""
    root = tmp_path_factory.mktemp("finished")
    old = os.umask(0o022)
    try:
        c = build(_cfg(tiny_target_dir, tiny_data_file, root / "run", root / "cache"))
        res = fit(c)
    finally:
        os.umask(old)
    return root, res, _params(c)


def _copy_run(finished, tmp_path) -> Path:
    root, _, _ = finished
    dst = tmp_path / "run"
    shutil.copytree(root / "run", dst)
    return dst


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def test_every_checkpoint_records_sizes_and_checksums(finished):
    _, res, _ = finished
    for ck in list_checkpoints(res.final_checkpoint.parent.parent):
        files = json.loads((ck / MANIFEST).read_text())["files"]
        on_disk = {p.relative_to(ck).as_posix() for p in ck.rglob("*") if p.is_file() and p.name != MANIFEST}
        assert set(files) == on_disk and {"draft/model.safetensors", "state/model.safetensors",
                                          "trainer_state.json"} <= on_disk
        assert all(files[f]["size"] == (ck / f).stat().st_size for f in files)
        assert verify_folder(ck) == []


def test_each_file_truncated_in_turn_is_named(finished, tmp_path):
    _, res, _ = finished
    files = json.loads((res.final_checkpoint / MANIFEST).read_text())["files"]
    for rel, meta in files.items():
        if meta["size"] < 2:
            continue
        ck = tmp_path / rel.replace("/", "_")
        shutil.copytree(res.final_checkpoint, ck)
        _truncate(ck / rel)
        problems = verify_folder(ck)
        assert len(problems) == 1 and problems[0].startswith(str(ck / rel)), (rel, problems)
        assert "truncated" in problems[0]
    # same size, other bytes: the checksum catches it
    ck = tmp_path / "flipped"
    shutil.copytree(res.final_checkpoint, ck)
    f = ck / "state" / "optimizer.bin"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))
    assert "checksum" in verify_folder(ck)[0]


@pytest.mark.parametrize("victim", ["state/model.safetensors", "draft/model.safetensors", "state/optimizer.bin",
                                    "trainer_state.json"])
def test_resume_moves_a_corrupt_checkpoint_aside_and_falls_back(victim, finished, tiny_target_dir, tiny_data_file,
                                                                tmp_path, capsys):
    _, _, final_weights = finished
    run = _copy_run(finished, tmp_path)
    _truncate(run / "checkpoints" / "step-0000006" / victim)
    c = build(_cfg(tiny_target_dir, tiny_data_file, run, tmp_path / "cache", ["trainer.resume=auto"]))
    res = fit(c)
    out = capsys.readouterr().out
    print([line for line in out.splitlines() if line.startswith("[")])
    assert f"step-0000006 is corrupt: {run / 'checkpoints' / 'step-0000006' / victim}" in out
    assert "resumed from" in out and "step-0000003 at step 3" in out
    aside = run / "checkpoints" / "step-0000006.corrupt"
    assert aside.is_dir() and (aside / victim).exists() and (aside / "CORRUPT.txt").exists()  # kept, not deleted
    assert res.step == 6 and [p.name for p in list_checkpoints(run)] == ["step-0000003", "step-0000006"]
    for k, v in _params(c).items():  # the fallback retrains steps 4-6 exactly
        assert torch.allclose(v, final_weights[k], atol=1e-6), k


def test_resume_refuses_when_every_checkpoint_is_corrupt(finished, tiny_target_dir, tiny_data_file, tmp_path):
    run = _copy_run(finished, tmp_path)
    for ck in list_checkpoints(run):
        _truncate(ck / "draft" / "model.safetensors")
    c = build(_cfg(tiny_target_dir, tiny_data_file, run, tmp_path / "cache", ["trainer.resume=auto"]))
    with pytest.raises(CorruptCheckpoint, match="every checkpoint"):
        fit(c)
    assert (run / "metrics.jsonl").exists() and len(list((run / "checkpoints").glob("*.corrupt"))) == 2


def test_evaluate_refuses_a_corrupt_draft_by_name(finished, tiny_target_dir, tmp_path):
    from specdistill.eval.run import load_draft
    from specdistill.models.target import load_causal_lm, load_tokenizer

    run = _copy_run(finished, tmp_path)
    draft = run / "checkpoints" / "step-0000006" / "draft"
    _truncate(draft / "model.safetensors")
    cfg = compose("kd", [f"target.path={tiny_target_dir}", f"eval.draft_path={draft}"])
    with pytest.raises(CorruptCheckpoint) as e:
        load_draft(cfg, load_causal_lm(str(tiny_target_dir)), load_tokenizer(str(tiny_target_dir)), log=print)
    print(e.value)
    assert str(draft / "model.safetensors") in str(e.value)


def _eagle3_head_dir(tmp_path):
    from specdistill.drafts.eagle3.model import build_eagle3

    target = make_tiny_lm(97, layers=4, hidden=32, seed=1)
    target.save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    head = build_eagle3(target, torch.randperm(97)[:40].sort().values, [1, 2, 3])
    head.save_pretrained(tmp_path / "head")
    return tmp_path / "head", tmp_path / "target"


def test_export_refuses_a_truncated_head_by_name(tmp_path):
    from specdistill.drafts.eagle3.export import export_eagle3

    head, _ = _eagle3_head_dir(tmp_path)
    _truncate(head / "model.safetensors")
    with pytest.raises(CorruptCheckpoint, match="model.safetensors: truncated") as e:
        export_eagle3(head, tmp_path / "out")
    print(e.value)
    assert not (tmp_path / "out").exists()


def test_exports_and_checkpoints_follow_the_umask(finished, tmp_path):
    from specdistill.drafts.eagle3.export import export_eagle3

    head, target = _eagle3_head_dir(tmp_path)
    old = os.umask(0o022)
    try:
        res = export_eagle3(head, tmp_path / "out", target_path=str(target))
    finally:
        os.umask(old)
    _, fit_res, _ = finished
    for root in (res.out_dir, fit_res.final_checkpoint):
        for p in [root, *root.rglob("*")]:
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))


def test_rerunning_a_finished_run_leaves_every_file_byte_identical(finished, tiny_target_dir, tiny_data_file,
                                                                   tmp_path, capsys):
    """Re-running a finished run with trainer.resume=auto must not overwrite summary.json with nulls."""
    from specdistill.pipeline.run import run as train_run

    run = _copy_run(finished, tmp_path)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert json.loads((run / "summary.json").read_text())["heldout_after"]
    res = train_run(_cfg(tiny_target_dir, tiny_data_file, run, tmp_path / "cache", ["trainer.resume=auto"]))
    out = capsys.readouterr().out
    print([line for line in out.splitlines() if line.startswith("[")])
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before
    assert "nothing to do" in out and "summary.json" in out
    assert "[threads] torch uses" in out  # train.py sets and prints its threads
    assert res.nothing_to_do and res.final_checkpoint == run / "checkpoints" / "step-0000006"
    assert res.heldout_after == json.loads((run / "summary.json").read_text())["heldout_after"]


def test_a_warm_start_from_a_corrupt_draft_is_refused_before_loading(finished, tiny_target_dir, tiny_data_file,
                                                                     tmp_path):
    run = _copy_run(finished, tmp_path)
    draft = run / "checkpoints" / "step-0000006" / "draft"
    _truncate(draft / "model.safetensors")
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "c")
                  + ["draft=pretrained", f"draft.path={draft}"])
    with pytest.raises(CorruptCheckpoint, match="draft.path draft"):
        build(cfg)
