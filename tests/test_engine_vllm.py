"""vLLM serves an exported EAGLE-3 head at the acceptance specdistill's evaluator measured for it.

Marked `engine`. It runs where a Python with vLLM is found: $SPECDISTILL_VLLM_PYTHON (vLLM's CPU build in its own
venv, as `bash scripts/engine_test.sh` installs it), or this interpreter when it imports vllm; else it is skipped.
One recipe=eagle3_serve run on a tiny Llama target (regenerate, train, final evaluation, vLLM export) gives the head
and our tau; scripts/vllm_check.py serves the export in vLLM on the same prompts, greedy, and reports vLLM's tau.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import WORDS, compose, make_tiny_lm, make_tokenizer, tiny_overrides


def vllm_python() -> str | None:
    """A Python that imports vllm: $SPECDISTILL_VLLM_PYTHON, else this one if it has vllm, else None."""
    if os.environ.get("SPECDISTILL_VLLM_PYTHON"):
        return os.environ["SPECDISTILL_VLLM_PYTHON"]
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    vllm_python() is None, reason="vLLM is not installed: `bash scripts/engine_test.sh` installs vLLM's CPU build in "
                                  ".venv-vllm and runs this test (or set SPECDISTILL_VLLM_PYTHON)")]

REPO = Path(__file__).resolve().parents[1]
GAMMA, PROMPTS, NEW_TOKENS = 3, 8, 32
# tau on the evaluator's terms: generated tokens per target forward that emits tokens. vLLM's prefill emits the first
# token and each of its verification rounds (num_drafts) emits more; the evaluator's first round scores the prompt's
# last token. vLLM's own tau, 1 + accepted / drafts, also counts drafts accepted past max_tokens. With the same greedy
# tokens the two differ only where a near-tie argmax falls the other way in vLLM's CPU kernels.
TAU_BAND = 0.05  # relative


def vllm_tau(served: dict, num_prompts: int) -> float:
    """vLLM's counts -> generated tokens per token-emitting target forward (the evaluator's mean_accept_len)."""
    return served["new_tokens"] / (served["num_drafts"] + num_prompts)


def _questions(path: Path) -> Path:
    """MT-bench-format rows (question_id, category, turns): what vllm_check.py and the evaluator both read."""
    rows = [{"question_id": i, "category": "writing", "turns": [" ".join(WORDS[i::PROMPTS][:6])]}
            for i in range(PROMPTS)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _tiny_target(path: Path) -> Path:
    # 4 heads of 64: a head size vLLM's CPU attention supports
    tok = make_tokenizer()
    make_tiny_lm(len(tok), layers=4, hidden=256).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_vllm_serves_the_exported_head_at_the_evaluators_tau(tiny_data_file, tmp_path):
    from specdistill.pipeline.run import run

    target, questions = _tiny_target(tmp_path / "target"), _questions(tmp_path / "questions.jsonl")
    out = tmp_path / "run"
    run(compose("eagle3_serve", tiny_overrides(target, tiny_data_file, out, tmp_path / "cache") + [
        "trainer.epochs=null", "trainer.max_steps=40", "trainer.lr=3e-3", "trainer.micro_batch_size=4",
        "trainer.export_formats=[vllm]", "eval.spec_eval=true", f"eval.prompts={questions}",
        f"eval.num_prompts={PROMPTS}", f"eval.max_new_tokens={NEW_TOKENS}", f"eval.gamma={GAMMA}", "eval.batch_size=1",
        "eval.batch_sizes=[1]", "eval.measure_cost=false", "data.regenerate.max_new_tokens=32",
        "draft.draft_vocab_size=256"]))  # a reduced draft vocabulary, as every recipe trains: vLLM maps it by d2t
    ours = out / "eval" / "final" / "results.json"
    served = tmp_path / "vllm.json"
    proc = subprocess.run(
        [vllm_python(), str(REPO / "scripts" / "vllm_check.py"), "--target", str(target),
         "--draft", str(out / "export" / "vllm"), "--questions", str(questions), "--num-prompts", str(PROMPTS),
         "--max-tokens", str(NEW_TOKENS), "--gamma", str(GAMMA), "--ours", str(ours), "--out", str(served)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    v, o = json.loads(served.read_text()), json.loads(ours.read_text())
    assert v["weights_match"], (v.get("weights_mismatched"), v.get("vllm_params_not_from_export"))
    assert v["draft_config_aux_ids"] == v["target_aux_hidden_state_layers"]
    # a head that accepts drafts, so that equal acceptance means something
    assert o["greedy_mismatches"] == 0 and o["mean_accept_len"] > 1.5
    assert v["new_tokens"] == o["new_tokens"]
    tau = vllm_tau(v, PROMPTS)
    assert tau == pytest.approx(o["mean_accept_len"], rel=TAU_BAND), (tau, v["mean_accept_len"], o["mean_accept_len"])
