"""Settings a run would ignore are refused, and faults are named with their fix: a DFlash gamma above what a block
drafts, keys appended with `+`, rows longer than the target's positions, draft heads given as the target, a run_name
that escapes, and the smaller cases (byte order marks, folders as files, CUDA without CUDA, full disks inside
safetensors, unreadable or reused locks, W&B without network, unquoted non-ASCII overrides)."""
import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdistill.build import build
from specdistill.config import RECIPES_DIR, Config
from specdistill.validation import ConfigError, nearest_key, schema_keys, validate_config
from tests.conftest import compose, compose_tiny, make_tiny_lm, make_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


# ------------------------------------------------------------------------------------------ DFlash gamma
@pytest.mark.parametrize("extra, key, fix", [
    ([], "eval.gamma=7", "eval.gamma=3"),  # the recipe's gamma with a smaller block
    (["eval.gamma=3", "eval.dynamic_gamma=true", "eval.max_gamma=6"], "eval.max_gamma=6", "eval.max_gamma=3"),
    (["eval.gamma=3", "eval.tree.topk=2", "eval.tree.depth=5"], "eval.tree.depth=5", "eval.tree.depth=3"),
])
def test_a_dflash_gamma_above_block_size_minus_one_is_refused_by_name_before_decoding(
        extra, key, fix, tiny_target_dir, tiny_data_file, tmp_path, no_model_loads):
    block = ["draft.dflash.block_size=4", "eval.spec_eval=true"]
    with pytest.raises(ConfigError) as e:
        build(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, block + extra, recipe="dflash_serve"))
    print(e.value)
    assert key in str(e.value) and f"set {fix}" in str(e.value) and "draft.dflash.block_size=4" in str(e.value)
    ok = ["eval.gamma=3"] + [x for x in extra if not x.startswith("eval.gamma")]
    ok = [x.replace("max_gamma=6", "max_gamma=3").replace("depth=5", "depth=3") for x in ok]
    assert validate_config(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, block + ok, recipe="dflash_serve"),
                           log=None) == []


def test_an_evaluation_reads_the_block_size_of_the_drafter_at_eval_draft_path(tiny_target_dir, tmp_path, monkeypatch):
    import specdistill.eval.run as eval_run
    from specdistill.drafts.dflash.model import build_dflash

    draft = tmp_path / "ck" / "draft"
    build_dflash(_lm(tiny_target_dir), num_layers=1, block_size=4, target_layer_ids=None,
                 mask_token_id=0).save_pretrained(draft)
    monkeypatch.setattr(eval_run, "_evaluate", lambda *a: pytest.fail("decoded with a gamma the block cannot draft"))
    cfg = compose(None, [f"target.path={tiny_target_dir}", f"eval.draft_path={draft}", "eval.gamma=6",
                         f"eval.output_dir={tmp_path / 'eval'}"])
    with pytest.raises(ConfigError, match=r"eval.gamma=6 .*the drafter at eval.draft_path has block_size=4.*"
                                          r"set eval.gamma=3"):
        eval_run.run(cfg, log=lambda *_: None)


# ------------------------------------------------------------------------------------------ closed schema
@pytest.mark.parametrize("override, said", [
    ("+trainer.max_step=5", "did you mean trainer.max_steps?"),  # Hydra's own suggestion for the typo
    ("+trainer.foo=1", "trainer.foo is not a setting"),
    ("+eval.tree.dept=2", "did you mean eval.tree.depth?"),
    ("+datta.path=x.jsonl", "did you mean data.path?"),
])
def test_keys_appended_with_plus_are_refused_with_the_nearest_known_key(override, said, tiny_target_dir,
                                                                         tiny_data_file, tmp_path, no_model_loads):
    with pytest.raises(ConfigError) as e:
        build(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, [override]))
    print(e.value)
    assert said in str(e.value) and "schema is closed" in str(e.value)


def test_every_recipe_composes_to_known_keys_only_and_a_mistyped_key_finds_its_own_name():
    from specdistill.validation import unknown_key_errors

    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        assert unknown_key_errors(compose(path.stem, [])) == [], path.stem
    known = schema_keys(Config)
    leaves = [k for k, nested in known.items() if nested is None]
    for key in leaves:  # one letter doubled: the suggestion is the key itself
        parent, _, name = key.rpartition(".")
        typo = f"{parent + '.' if parent else ''}{name}{name[-1]}"
        assert nearest_key(typo, known) == f"did you mean {key}?", key


# ------------------------------------------------------------------------------------------ sequence length
def test_one_rule_for_rows_against_the_targets_positions():
    import datasets

    from specdistill.data.dataset import TokenizedData, check_rows_fit

    def data(lengths):
        rows = {"input_ids": [[1] * n for n in lengths], "loss_mask": [[1] * n for n in lengths]}
        return TokenizedData(datasets.Dataset.from_dict(rows), datasets.Dataset.from_dict(rows), [], {})

    check_rows_fit(data([10, 32]), 32, max_length=64)  # a row of exactly the limit fits
    check_rows_fit(data([10, 500]), None, max_length=512)  # a model without a limit
    with pytest.raises(ValueError, match=r"longest of 4 training rows \(of 6\) has 40 tokens.*"
                                         r"max_position_embeddings=32.*data.max_length=32.*now 64"):
        check_rows_fit(data([10, 33, 40]), 32, max_length=64)


def test_regeneration_longer_than_the_targets_positions_is_refused_naming_both_settings(tiny_data_file, tmp_path,
                                                                                          monkeypatch):
    import specdistill.pipeline.regenerate as regen

    short = tmp_path / "short_target"
    make_tiny_lm(len(make_tokenizer()), layers=1, max_pos=32).save_pretrained(short)
    make_tokenizer().save_pretrained(short)

    def no_regeneration(*_, **__):
        raise AssertionError("regeneration started before the refusal")
    monkeypatch.setattr(regen, "regenerate_store", no_regeneration)
    cfg = compose_tiny(short, tiny_data_file, tmp_path,
                       ["data.max_length=32", f"data.regenerate.prompts={tiny_data_file}",
                        "data.regenerate.max_prompt_tokens=24", "data.regenerate.max_new_tokens=12"],
                       recipe="eagle3_serve")
    with pytest.raises(ValueError, match=r"max_prompt_tokens=24 \+ data.regenerate.max_new_tokens=12 = 36.*32 "
                                         r"positions.*at most 32"):
        build(cfg, make_data=regen.build_regenerated_data)


def test_training_refuses_rows_longer_than_the_targets_positions(tiny_data_file, tmp_path):
    short = tmp_path / "short_target"
    make_tiny_lm(len(make_tokenizer()), layers=1, max_pos=32).save_pretrained(short)
    make_tokenizer().save_pretrained(short)
    with pytest.raises(ValueError, match=r"max_position_embeddings=32.*set data.max_length=32"):
        build(compose_tiny(short, tiny_data_file, tmp_path, ["data.max_length=64"]))
    build(compose_tiny(short, tiny_data_file, tmp_path, ["data.max_length=32"]))  # cut to the limit, it trains


# ------------------------------------------------------------------------------------------ target.path
@pytest.fixture(scope="module")
def draft_folders(tiny_target_dir, tmp_path_factory):
    """Folders of drafts that are not causal LMs: EAGLE-3 heads (full and reduced vocabulary, and the speculators
    export) and a DFlash drafter."""
    from specdistill.drafts.dflash.model import build_dflash
    from specdistill.drafts.eagle3.export import export_eagle3
    from specdistill.drafts.eagle3.model import build_eagle3

    root, target = tmp_path_factory.mktemp("drafts"), _lm(tiny_target_dir)
    V = target.config.vocab_size
    build_eagle3(target, torch.arange(V), None).save_pretrained(root / "eagle3_full")
    build_eagle3(target, torch.arange(0, V, 2), None).save_pretrained(root / "eagle3_reduced")
    export_eagle3(root / "eagle3_reduced", root / "speculators", fmt="speculators", target_path=str(tiny_target_dir))
    build_dflash(target, num_layers=1, block_size=4, target_layer_ids=None, mask_token_id=0).save_pretrained(
        root / "dflash")
    return root


@pytest.mark.parametrize("name, said", [("eagle3_full", "is an EAGLE-3 head (architectures"),
                                        ("eagle3_reduced", "is an EAGLE-3 head with a reduced vocabulary"),
                                        ("speculators", "is an EAGLE-3 head"),
                                        ("dflash", "is a DFlash block drafter")])
def test_a_draft_folder_given_as_the_target_is_refused_by_name(name, said, draft_folders, tiny_data_file, tmp_path,
                                                                no_model_loads):
    with pytest.raises(ValueError) as e:
        build(compose_tiny(draft_folders / name, tiny_data_file, tmp_path))
    print(e.value)
    assert f"target.path='{draft_folders / name}' {said}" in str(e.value) and "eval.draft_path" in str(e.value)


def test_a_target_missing_decoder_weights_is_an_error_not_a_warning(tiny_target_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from specdistill.models.target import NotACausalLM, load_causal_lm

    broken = tmp_path / "broken"
    _lm(tiny_target_dir).save_pretrained(broken)
    weights = load_file(broken / "model.safetensors")
    dropped = sorted(k for k in weights if k.startswith("model.layers.1."))
    save_file({k: v for k, v in weights.items() if k not in dropped}, broken / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(NotACausalLM, match=rf"target.path='{broken}' lacks {len(dropped)} of its model's weights "
                                           rf"\({dropped[0]}"):
        load_causal_lm(str(broken))
    assert load_causal_lm(str(tiny_target_dir)).config.num_hidden_layers == 4  # a whole checkpoint loads


# ------------------------------------------------------------------------------------------ the data's small cases
def test_invalid_utf8_in_regeneration_prompts_is_counted(tmp_path):
    from specdistill.config import RegenerateConfig
    from specdistill.pipeline.regenerate import load_prompt_rows

    f = tmp_path / "prompts.jsonl"
    f.write_bytes(b'{"prompt": "caf\xe9 and cr\xe8me"}\n{"prompt": "plain"}\n')
    said = []
    ids, _ = load_prompt_rows(RegenerateConfig(prompts=str(f)), make_tokenizer(), 8, log=said.append)
    assert len(ids) == 2 and any("2 replacement characters" in s and str(f) in s for s in said), said


def test_invalid_utf8_in_the_regeneration_scripts_data_is_counted(tiny_target_dir, tmp_path, capsys):
    from specdistill.cli.regenerate import main

    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"id": "a", "messages": [{"role": "user", "content": "caf\xe9 cr\xe8me"}, '
                  b'{"role": "assistant", "content": "ok"}]}\n')
    main(["--target", str(tiny_target_dir), "--data", str(f), "--out", str(tmp_path / "out.jsonl"),
          "--max-new-tokens", "2", "--max-prompt-tokens", "24", "--threads", "1"])
    printed = capsys.readouterr().out
    assert "2 replacement characters" in printed and "1 conversations" in printed and str(f) in printed, printed


def test_a_byte_order_mark_does_not_drop_the_first_row(tmp_path):
    from specdistill.data.conversations import load_rows, normalize

    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    convs = normalize(load_rows(str(f), keep_bad=True))
    assert len(convs.conversations) == 3 and not convs.malformed
    assert convs.conversations[0][0]["content"] == "q0"


@pytest.mark.parametrize("key", ["data.path", "eval.prompts"])
def test_a_folder_given_as_a_data_or_prompt_file_is_refused_naming_the_files_inside(key, tiny_target_dir,
                                                                                    tiny_data_file, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text(Path(tiny_data_file).read_text())
    with pytest.raises(ConfigError, match=rf"{key}='{folder}' is a folder.*e.g. {key}={folder / 'part-0.jsonl'}"):
        validate_config(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, [f"{key}={folder}"]), log=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where CUDA is missing")
def test_eval_device_cuda_without_cuda_is_refused_naming_cpu(tiny_target_dir, tiny_data_file, tmp_path):
    with pytest.raises(ConfigError, match=r"eval.device=cuda: .*set eval.device=cpu"):
        validate_config(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, ["eval.device=cuda"]), log=None)


# ------------------------------------------------------------------------------------------ recipes and draft kinds
@pytest.mark.parametrize("recipe, draft, own", [("kd", "dflash", "dflash"), ("eagle3", "dflash", "dflash"),
                                                ("sft", "dflash", "dflash"), ("kd", "eagle3", "eagle3")])
def test_an_objective_that_cannot_train_a_draft_kind_is_refused_before_loading(recipe, draft, own, tiny_target_dir,
                                                                              tiny_data_file, tmp_path,
                                                                              no_model_loads):
    with pytest.raises(ValueError, match=rf"objective={recipe} cannot train a {draft} draft.*objective={own}"):
        build(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, [f"draft={draft}"], recipe=recipe))


# ------------------------------------------------------------------------------------------ folders and locks
def test_a_run_name_that_escapes_creates_nothing_outside(tmp_path):
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "specdistill.cli.train", "recipe=kd", "run_name=../../escape"],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "run_name='../../escape' must name a folder inside" in p.stdout + p.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b"]  # no escaped folder, no outputs/


def test_a_read_only_output_folder_is_named_before_the_lock(tmp_path):
    from specdistill.files import WriteFailed, folder_lock

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(WriteFailed, match=rf"{blocker / 'out'} is not writable.*eval.output_dir=<a writable"):
        with folder_lock(blocker / "out", "eval.output_dir"):
            pass


def test_an_unreadable_lock_says_so_and_how_to_clear_it(tmp_path):
    from specdistill.files import LOCK_FILE, FolderBusy, folder_lock

    (tmp_path / LOCK_FILE).write_text("")
    with pytest.raises(FolderBusy) as e:
        with folder_lock(tmp_path, "trainer.output_dir"):
            pass
    assert "unreadable" in str(e.value) and f"delete {tmp_path / LOCK_FILE}" in str(e.value)
    assert "pid ?" not in str(e.value)


def test_a_lock_whose_pid_now_belongs_to_a_newer_process_is_taken_over(tmp_path):
    from specdistill.files import LOCK_FILE, FolderBusy, folder_lock

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def hold(started: float):
            (tmp_path / LOCK_FILE).write_text(json.dumps({
                "pid": other.pid, "host": socket.gethostname(), "command": "train.py recipe=kd",
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))}))

        hold(time.time() + 60)  # taken after the process started: it may be the run
        with pytest.raises(FolderBusy, match=rf"in use by another run: pid {other.pid}"):
            with folder_lock(tmp_path, "trainer.output_dir"):
                pass
        hold(time.time() - 3600)  # taken an hour before the process with that pid started: the pid was reused
        said = []
        with folder_lock(tmp_path, "trainer.output_dir", log=said.append):
            assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert any("now belongs to a process started after the lock was taken" in s for s in said), said
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------------------------ writes and the network
def test_a_full_disk_inside_a_safetensors_write_names_the_folder_and_setting(draft_folders, tmp_path, monkeypatch,
                                                                                capsys):
    import safetensors
    import safetensors.torch

    from specdistill.cli.export import main
    from specdistill.files import WriteFailed, named_writes

    full = safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(WriteFailed, match=rf"could not write to {tmp_path}: no space left.*trainer.output_dir=") as e:
        with named_writes(tmp_path, "trainer.output_dir", "nothing kept"):
            raise full
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(safetensors.SafetensorError):  # any other safetensors error passes through unchanged
        with named_writes(tmp_path, "trainer.output_dir", "nothing kept"):
            raise safetensors.SafetensorError("Error while deserializing header: HeaderTooLarge")

    def no_space(*a, **k):
        raise full

    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    assert main(["--draft", str(draft_folders / "eagle3_reduced"), "--out", str(tmp_path / "x" / "vllm")]) == 2
    assert "no space left" in capsys.readouterr().err


def test_wandb_online_without_network_logs_offline_with_a_warning(tiny_target_dir, tiny_data_file, tmp_path,
                                                                  monkeypatch):
    from specdistill.cli.train import wandb_offline_without_network

    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, ["trainer.wandb=true", "trainer.wandb_mode=online"])
    said = []
    assert not wandb_offline_without_network(cfg, log=said.append, reachable=lambda: True)
    assert cfg.trainer.wandb_mode == "online" and not said
    assert wandb_offline_without_network(cfg, log=said.append, reachable=lambda: False)
    assert cfg.trainer.wandb_mode == "offline" and os.environ["WANDB_MODE"] == "offline"
    assert "W&B server does not answer" in said[0] and "wandb sync" in said[0]
    cfg = compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, ["trainer.wandb=false", "trainer.wandb_mode=online"])
    assert not wandb_offline_without_network(cfg, reachable=lambda: pytest.fail("probed without wandb"))


@pytest.mark.parametrize("error", ["UsageError", "CommError"])
def test_wandb_refusing_an_online_run_logs_offline_with_a_warning(error, tiny_target_dir, tiny_data_file, tmp_path,
                                                                  monkeypatch, capsys):
    from types import SimpleNamespace

    import wandb

    from specdistill.build import make_accelerator
    from specdistill.entry import load_config
    from specdistill.train.loop import _open_run

    modes = []

    def init(*_, mode=None, **__):
        modes.append(mode)
        if mode == "online":
            raise getattr(wandb.errors, error)("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
        return SimpleNamespace()
    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "config", SimpleNamespace(update=lambda *_, **__: None))
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = load_config(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path,
                                   ["trainer.wandb=true", "trainer.wandb_mode=online"]))
    c = SimpleNamespace(accelerator=make_accelerator(cfg.trainer), trainer=cfg.trainer, run_name=cfg.run_name,
                        output_dir=tmp_path / "o", data=SimpleNamespace(report={}))
    _open_run(c, "run: config\n")
    said = capsys.readouterr().out
    assert modes == ["online", "offline"] and os.environ["WANDB_MODE"] == "offline"
    assert error in said and "`wandb login`" in said and "trainer.wandb_mode=offline" in said, said
    assert (tmp_path / "o" / "config.yaml").read_text() == "run: config\n"


@pytest.mark.parametrize("command, key", [("train", "trainer.output_dir"), ("evaluate", "eval.output_dir")])
def test_an_unquoted_non_ascii_override_is_refused_with_the_quoting(command, key, tmp_path, monkeypatch):
    import importlib

    main = importlib.import_module(f"specdistill.cli.{command}").main
    monkeypatch.setattr(sys, "argv", [f"specdistill-{command}", "recipe=kd", f"{key}={tmp_path}/résultats"])
    with pytest.raises(SystemExit) as e:
        main()
    assert f"""'{key}="{tmp_path}/résultats"'""" in str(e.value.code)
    assert not (tmp_path / "résultats").exists()


# ------------------------------------------------------------------------------------------ what the cost model serves
def test_the_cost_model_recommends_only_what_engines_serve_for_a_drafter_without_served_trees():
    from specdistill.decoding.tree import TreeShape
    from specdistill.eval.tree_cost import (Setting, VerifyCurve, best, chain_settings, cost_model_markdown,
                                            cost_model_report, tree_report)

    curve = VerifyCurve(step_ms=1.0, ms=[1.0] * 32, context_tokens=64)
    chains = chain_settings([0.8, 0.6, 0.4], 0.05, curve)
    shape = TreeShape(3, 3, 8)
    tree = Setting(shape.name, 3.5, 0.1, shape.size + 1, 1.0, flags=shape.sglang_flags(), shape=shape)
    assert best(chains + [tree]) is tree  # the tree is predicted fastest
    served = cost_model_report(curve, chains + [tree])
    assert served["recommended"] == tree.name and served["recommended_sglang"] == shape.sglang_flags()
    chains_only = cost_model_report(curve, chains + [tree], serves_trees=False)
    rec = best(chains, True)
    assert chains_only["recommended"] == rec.name and chains_only["recommended_sglang"] == rec.flags
    tree_row = next(r for r in chains_only["settings"] if r["name"] == tree.name)
    assert "sglang" not in tree_row and tree_row["served"] is False
    assert "no serving engine decodes them" in " ".join(cost_model_markdown(chains_only))
    assert "sglang" not in tree_report(shape, None, serves_trees=False)
    assert tree_report(TreeShape(1, 3), None, serves_trees=False)["sglang"]  # a chain is served


def test_an_lm_draft_whose_config_disagrees_with_its_tensors_is_refused_by_name(tmp_path):
    from specdistill.drafts.lm import LMDraft
    from specdistill.models.target import NotACausalLM

    folder = tmp_path / "draft"
    make_tiny_lm(100, layers=1, hidden=16).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(NotACausalLM, match=rf"eval.draft_path='{folder}': its config.json disagrees with the shapes"):
        LMDraft.load(folder)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(NotACausalLM, match=r"eval.draft_path=.* lacks 9 of its model's weights \(model.layers.1"):
        LMDraft.load(folder)
