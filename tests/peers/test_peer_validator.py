"""ModelOpt's own validator in the peers benchmark, without ModelOpt: the validate block its arms' specs carry (the
evaluator's first MT-bench prompts, the primary gamma, --eval-tokens), validate.json's summary and error records, and
the report section that shows its mean AR beside our evaluator's tau."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.peers.arms import HeadShape
from benchmarks.peers.peer_train import MODELOPT_VALIDATOR, summarise_ar, write_validation
from benchmarks.peers.run import peer_spec, peer_validator_lines, validator_prompt_ids, write_report
from tests.conftest import compose, make_tokenizer

IDS = [[5, 6, 7], [8, 9]]


def args(**over):
    base = {"epochs": 1, "seed": 0, "wall_seconds": None, "threads": 2, "gammas": [3, 4], "eval_tokens": 16}
    return SimpleNamespace(**{**base, **over})


def pdata():
    data = {p: {"root": f"/d/{p}"} for p in ("speculators", "specforge", "modelopt")}
    return {"data": data, "max_len": 100, "mean_len": 50.0}


@pytest.mark.parametrize("kind", ["defaults", "ours", "ours-1row"])
def test_modelopt_arms_carry_the_validate_block_at_the_primary_gamma(tmp_path, kind):
    spec = peer_spec(args(), "modelopt", kind, HeadShape(), "/t", pdata(), tmp_path, IDS)
    assert spec["validate"] == {"prompt_ids": IDS, "gamma": 3, "max_new_tokens": 16}
    assert spec["out"] == str(tmp_path / "arms" / f"modelopt-{kind}")
    assert json.loads(json.dumps(spec))["validate"]["prompt_ids"] == IDS  # spec.json holds it as written


def test_speculators_packs_one_rows_worth_of_tokens_at_one_row_per_step(tmp_path):
    """speculators packs tokens, so rows per step reach it as tokens per step: 8 mean rows, or the longest row at 1."""
    def tokens(kind):
        return peer_spec(args(), "speculators", kind, HeadShape(), "/t", pdata(), tmp_path, [])["tokens_per_step"]
    assert (tokens("ours"), tokens("ours-1row")) == (400, 100)
    assert tokens("defaults") == 8192


def test_no_validate_block_without_prompts_or_for_peers_without_a_validator(tmp_path):
    assert "validate" not in peer_spec(args(), "modelopt", "defaults", HeadShape(), "/t", pdata(), tmp_path, [])
    for peer in ("speculators", "specforge"):
        assert "validate" not in peer_spec(args(), peer, "defaults", HeadShape(), "/t", pdata(), tmp_path, IDS)


def test_validator_prompts_are_the_first_of_the_evaluators_prompts():
    from specdistill.assets import mt_bench_rows
    from specdistill.data.prompts import load_prompts

    tok = make_tokenizer()
    ev = compose(None, []).eval  # what scripts/evaluate.py composes (no recipe), for its prompt set and length cap
    scored = load_prompts(ev.prompts, tok, num_prompts=5, max_new_tokens=16, context=4096,
                          max_prompt_tokens=ev.max_prompt_tokens).ids
    ids = validator_prompt_ids(tok, 3, 5, 16, 4096)
    assert ids == scored[:3] and len(ids) == 3
    text = tok.decode(ids[0])
    assert mt_bench_rows()[0]["messages"][0]["content"] in text and text.endswith("<|im_start|>assistant\n")
    assert validator_prompt_ids(tok, 10, 2, 16, 4096) == scored[:2]  # never past the evaluator's own prompts
    assert validator_prompt_ids(tok, 0, 5, 16, 4096) == []


def test_validation_record_is_the_mean_of_per_prompt_ars_and_says_why_it_is_not_pooled(tmp_path):
    rec = write_validation(tmp_path, {"gamma": 4, "max_new_tokens": 8}, lambda: [2.0, 3.5])
    saved = json.loads((tmp_path / "validate.json").read_text())
    assert saved == rec
    assert rec["validator"] == MODELOPT_VALIDATOR and rec["gamma"] == 4 and rec["max_new_tokens"] == 8
    assert rec["per_prompt_ar"] == [2.0, 3.5] and rec["prompts"] == 2 and rec["mean_ar"] == pytest.approx(2.75)
    assert "pooled_ar" not in rec and "per-prompt" in rec["note"] and rec["seconds"] >= 0
    assert "error" not in rec


def test_validator_failure_is_written_as_an_error_and_nothing_else(tmp_path):
    def boom():
        raise RuntimeError("Torch not compiled with CUDA enabled")

    rec = write_validation(tmp_path, {"gamma": 4, "max_new_tokens": 8}, boom)
    saved = json.loads((tmp_path / "validate.json").read_text())
    assert saved == rec and rec["error"] == "RuntimeError: Torch not compiled with CUDA enabled"
    assert "mean_ar" not in rec and "per_prompt_ar" not in rec and rec["gamma"] == 4
    empty = write_validation(tmp_path, {"gamma": 4, "max_new_tokens": 8}, lambda: [])
    assert empty["error"] == "ValueError: the validator scored no prompt" and "mean_ar" not in empty
    with pytest.raises(ValueError, match="non-finite"):
        summarise_ar([2.0, float("nan")], {"gamma": 4, "max_new_tokens": 8})


def results_with_validator(tmp_path) -> dict:
    ev = {"tau": 2.25, "accept_rate_per_pos": [0.5], "dir": str(tmp_path)}
    ok = {"validator": MODELOPT_VALIDATOR, "gamma": 4, "max_new_tokens": 8, "prompts": 2, "per_prompt_ar": [2.0, 3.5],
          "mean_ar": 2.75, "note": "n", "seconds": 12.4}
    return {"mode": "tiny", "command": "c", "budget": "1 epoch(s) per arm", "rows": 15, "loss_tokens": 360,
            "settings": ["T0-g4"], "arms": {
                "specdistill": {"evals": {"T0-g4": ev}},
                "modelopt-defaults": {"evals": {"T0-g4": ev}, "peer_validator": ok},
                "modelopt-ours": {"evals": {"T1-g4": ev}, "peer_validator": {
                    "validator": MODELOPT_VALIDATOR, "gamma": 4, "max_new_tokens": 8, "seconds": 0.5,
                    "error": "RuntimeError: boom"}}}}


def test_report_section_puts_the_validators_mean_ar_beside_our_tau(tmp_path):
    results = results_with_validator(tmp_path)
    lines = peer_validator_lines(results)
    assert lines[1] == "## ModelOpt's own validator (its forward, its metric)"
    assert "mean of the per-prompt ratios" in lines[3] and "restart after each correction" in lines[3]
    assert lines[-2:] == ["| modelopt-defaults | 2.7500 | 2 | 4 | 8 | 12 | 2.2500 (T0-g4) |",
                          "| modelopt-ours | failed: 'RuntimeError: boom' | - | 4 | 8 | 0 | not scored at T0-g4 |"]
    assert not any("| specdistill |" in x for x in lines)
    write_report(tmp_path, results)
    md = (tmp_path / "results.md").read_text()
    assert "## ModelOpt's own validator (its forward, its metric)" in md and lines[-2] in md


def test_no_validator_section_without_validator_results(tmp_path):
    results = results_with_validator(tmp_path)
    for rec in results["arms"].values():
        rec.pop("peer_validator", None)
    assert peer_validator_lines(results) == []
    write_report(tmp_path, results)
    assert "own validator" not in (tmp_path / "results.md").read_text()
