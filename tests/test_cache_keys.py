"""Caches are keyed by what they were made from, by content: the regenerated store, specdistill-regenerate's --out, the
tokenized-data cache and the converted embedded model. Each change of an input makes a new entry (or is refused, naming
the setting); no change reuses the old one."""
import json
import os

import pytest
import torch

from specdistill.config import RegenerateConfig
from specdistill.data.regenerated import part_path
from specdistill.pipeline.regenerate import regenerate_store
from tests.conftest import conversations, make_tiny_lm, make_tokenizer

AUX = [1, 2]


@pytest.fixture
def setup(tmp_path):
    torch.set_num_threads(1)
    tok = make_tokenizer()
    model = make_tiny_lm(len(tok), layers=3, hidden=32).eval()
    target = tmp_path / "target"
    model.save_pretrained(target)
    tok.save_pretrained(target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in conversations(8)))
    return model, tok, target, prompts


def _regen(setup, tmp_path, model=None, tok=None, target=None, log=lambda *_: None, **kw):
    m, t, folder, prompts = setup
    cfg = RegenerateConfig(**{"enabled": True, "prompts": str(prompts), "max_prompts": 4, "max_new_tokens": 4,
                              "batch_size": 4, "store_dir": str(tmp_path / "store"), **kw})
    root, _ = regenerate_store(cfg, model or m, tok or t, str(target or folder), AUX, log=log, progress=False)
    return root


def _edit_in_place(path, old: bytes, new: bytes):
    """Same path, same size, same modification time: only the bytes differ."""
    st = path.stat()
    data = path.read_bytes()
    assert old in data and len(old) == len(new)
    path.write_bytes(data.replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_each_input_change_makes_a_new_store_and_no_change_reuses_it(setup, tmp_path):
    model, tok, target, prompts = setup
    root = _regen(setup, tmp_path)
    stamp = part_path(root, 0).stat().st_mtime_ns
    assert _regen(setup, tmp_path) == root and part_path(root, 0).stat().st_mtime_ns == stamp  # reused as is
    recorded = json.loads((root / "settings.json").read_text())
    assert recorded["target_files"].startswith("sha256:") and recorded["prompts_bytes"].startswith("sha256:")

    # the prompts edited in place: another store; the old bytes back: the old store again
    original = prompts.read_bytes()
    first_word = json.loads(original.splitlines()[0])["conversations"][0]["value"].split()[0].encode()
    _edit_in_place(prompts, b'"value": "' + first_word, b'"value": "' + b"x" * len(first_word))
    said = []
    assert _regen(setup, tmp_path, log=said.append) != root
    assert any(f"not reusing {root}" in line and "prompts_bytes" in line for line in said)  # says why
    prompts.write_bytes(original)
    assert _regen(setup, tmp_path) == root

    # new weights saved into the same target folder
    other = make_tiny_lm(len(tok), layers=3, hidden=32, seed=1).eval()
    other.save_pretrained(target)
    assert _regen(setup, tmp_path, model=other) != root

    # other generation settings, another target folder, another chat template: each another store
    assert _regen(setup, tmp_path, max_new_tokens=3) != root
    elsewhere = tmp_path / "other_target"
    other.save_pretrained(elsewhere)
    tok.save_pretrained(elsewhere)
    assert _regen(setup, tmp_path, model=other, target=elsewhere) != root
    templated = make_tokenizer()
    templated.chat_template = templated.chat_template.replace("\n", "\n\n")
    assert _regen(setup, tmp_path, model=other, tok=templated, target=elsewhere) != _regen(
        setup, tmp_path, model=other, target=elsewhere)


def test_a_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    import hashlib

    from specdistill import cache

    monkeypatch.setattr(cache, "CACHE_ROOT", tmp_path / "cache")
    monkeypatch.setattr(cache, "_memo", {})
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(cache.hashlib, "sha256", lambda *a: calls.append(a) or real(*a))
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    d1 = cache.file_digest(f)
    monkeypatch.setattr(cache, "_memo", {})  # a new process: the record on disk is read, the file is not
    assert cache.file_digest(f) == d1 and len([c for c in calls if not c]) == 1  # one file hashed, once
    st = f.stat()
    f.write_bytes(b"b" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: the change time still moves
    assert cache.file_digest(f) != d1 and len([c for c in calls if not c]) == 2


def test_regenerate_cli_refuses_an_out_made_with_other_settings(setup, tmp_path, tiny_target_dir):
    from specdistill.cli import regenerate as regen

    _, _, target, prompts = setup
    out = tmp_path / "answers.jsonl"
    base = ["--data", str(prompts), "--max-rows", "2", "--max-new-tokens", "3", "--out", str(out), "--threads", "1"]
    regen.main(["--target", str(target)] + base)
    rows = out.read_text().splitlines()
    assert len(rows) == 2
    with pytest.raises(SystemExit, match="--max-new-tokens: 3 \\(stored\\) vs 4 \\(now\\)"):
        regen.main(["--target", str(target)] + base[:-6] + ["--max-new-tokens", "4"] + base[-4:])
    with pytest.raises(SystemExit, match="--target.*target files"):
        regen.main(["--target", str(tiny_target_dir)] + base)
    # the same settings resume (nothing left to do), and the file is unchanged
    regen.main(["--target", str(target)] + base)
    assert out.read_text().splitlines() == rows
    # a file with rows whose settings were never recorded is refused too
    (tmp_path / "answers.jsonl.settings.json").unlink()
    with pytest.raises(SystemExit, match="no answers.jsonl.settings.json"):
        regen.main(["--target", str(target)] + base)


def test_the_data_cache_key_follows_the_bytes(tmp_path):
    from specdistill.config import DataConfig
    from specdistill.data.dataset import _fingerprint

    f = tmp_path / "conv.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in conversations(4)))
    cfg = DataConfig(path=str(f), cache_dir=str(tmp_path / "cache"))
    tok = make_tokenizer()
    before = _fingerprint(cfg, tok)
    assert _fingerprint(cfg, tok) == before
    _edit_in_place(f, b'"value": "', b'"value": "')  # rewritten with the very same bytes: the same entry
    assert _fingerprint(cfg, tok) == before
    _edit_in_place(f, b'"human"', b'"hum@n"')
    assert _fingerprint(cfg, tok) != before


def test_the_converted_model_is_converted_again_when_its_gguf_changes(tmp_path, monkeypatch):
    from specdistill import assets, cache

    src = tmp_path / "pkg"
    src.mkdir()
    gguf = src / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"gguf-1")
    monkeypatch.setattr(assets, "CACHE_ROOT", tmp_path / "cache")
    monkeypatch.setattr(cache, "CACHE_ROOT", tmp_path / "cache")
    monkeypatch.setattr(assets, "_package_dir", lambda *a: src)
    converted = []

    def fake_convert(src_dir, gguf_file, out, made_from):
        converted.append(made_from["sha256"])
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"))
        (out / "converted_from.json").write_text(json.dumps(made_from))

    monkeypatch.setattr(assets, "_convert_gguf", fake_convert)
    path = assets.resolve_model_path("embedded:smollm2-135m-instruct")
    assert assets.resolve_model_path("embedded:smollm2-135m-instruct") == path and len(converted) == 1
    gguf.write_bytes(b"gguf-2")  # a new package version under the same name
    assets.resolve_model_path("embedded:smollm2-135m-instruct")
    assert len(converted) == 2 and converted[0] != converted[1]


def test_offline_features_are_checked_against_the_targets_files(setup):
    from types import SimpleNamespace

    from specdistill.build import feature_meta
    from specdistill.config import TargetConfig

    _, tok, target, _ = setup
    cfg = TargetConfig(path=str(target), dtype="float32")
    data = SimpleNamespace(fingerprint="f")
    before = feature_meta(cfg, [1], data)
    assert feature_meta(cfg, [1], data) == before
    make_tiny_lm(len(tok), layers=3, hidden=32, seed=2).save_pretrained(target)  # new weights, same folder
    after = feature_meta(cfg, [1], data)
    assert after["target_files"] != before["target_files"] and after["target"] == before["target"]
