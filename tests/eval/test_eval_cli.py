"""scripts/evaluate.py: Hydra composes the training groups plus eval.*, builds or loads the draft, writes the report."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdistill.eval.report import PLOTS
from specdistill.eval.run import run
from tests.conftest import compose, make_tiny_lm, make_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]


def _overrides(target_dir, out, *extra):
    return [f"target.path={target_dir}", "target.dtype=float32", "draft.num_layers=1", "eval.num_prompts=3",
            "eval.max_new_tokens=6", f"eval.output_dir={out}", "eval.batch_size=2", "eval.batch_sizes=[1,2]",
            "eval.sweep_prompts=2", *extra]


def test_run_builds_the_draft_group_when_no_path(tiny_target_dir, tmp_path):
    r, paths = run(compose(None, _overrides(tiny_target_dir, tmp_path / "a")), log=lambda s: None)
    assert r.drafter == "draft" and r.greedy_mismatches == 0 and r.num_prompts == 3
    assert r.prompts == "embedded:mt_bench" and [p.batch_size for p in r.batch_sweep] == [1, 2]
    assert {*PLOTS, "results.json", "results.md", "outputs.jsonl"} <= {p.name for p in paths.values()}
    data = json.loads(paths["results.json"].read_text())
    assert data["config"]["drafter"] == "draft" and data["draft_path"] is None


def test_run_loads_a_trained_draft_folder(tiny_target_dir, tmp_path):
    tok = make_tokenizer()
    d = tmp_path / "ckpt" / "draft"
    make_tiny_lm(len(tok), layers=1, seed=3).save_pretrained(d)
    tok.save_pretrained(d)
    r, _ = run(compose(None, _overrides(tiny_target_dir, tmp_path / "b", f"eval.draft_path={d}",
                                        "eval.batch_sizes=[2]")), log=lambda s: None)
    assert r.greedy_mismatches == 0 and r.env["draft_params"] == sum(
        p.numel() for p in make_tiny_lm(len(tok), layers=1).parameters())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(compose(None, _overrides(tiny_target_dir, tmp_path / "c", f"eval.draft_path={tmp_path}/nope")),
            log=lambda s: None)


def test_the_script_runs_under_hydra(tiny_target_dir, tmp_path):
    out = tmp_path / "cli"
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), "eval.drafter=ngram",
                           *_overrides(tiny_target_dir, out, "eval.batch_sizes=[2]")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["drafter"] == "ngram" and data["greedy_mismatches"] == 0
    assert not (tmp_path / "outputs").exists()  # Hydra's run dir is eval.output_dir, not trainer.output_dir
    bad = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), "eval.drafer=ngram"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "drafer" in bad.stderr
