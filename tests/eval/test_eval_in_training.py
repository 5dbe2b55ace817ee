"""The epoch-end hook: a real speculative eval of the training draft, spec/ metrics, results.json, train mode
restored."""
import json
import time
from types import SimpleNamespace

from accelerate import Accelerator
from omegaconf import OmegaConf

from specdistill.train.spec_eval import spec_eval_hook
from specdistill.models.target import Target
from specdistill.objectives import Models
from tests.conftest import compose, make_tiny_lm


def _components(tok, tmp_path, overrides, heldout=None):
    composed = compose(None, ["eval.num_prompts=2", "eval.max_new_tokens=6", "eval.gamma=3", "eval.batch_sizes=[1,2]",
                              "eval.compare_hf=true"] + overrides)  # sweep and HF comparison are dropped in training
    ecfg = OmegaConf.to_object(composed.eval)  # the part the hook reads, typed as the entry makes it
    acc = Accelerator(cpu=True)
    draft = acc.prepare(make_tiny_lm(len(tok), layers=1, hidden=64, seed=1))
    draft.train()
    target = Target(make_tiny_lm(len(tok), layers=2, hidden=64, seed=0))
    data = SimpleNamespace(heldout_messages=heldout)
    return SimpleNamespace(eval=ecfg, target_shard="none", accelerator=acc, models=Models(draft, target, tok),
                           data=data, output_dir=tmp_path)


def test_hook_returns_spec_metrics_and_writes_results(tok, tmp_path):
    heldout = [[{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "on the mat"}],
               [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three"}]]
    c = _components(tok, tmp_path, ["eval.prompts=heldout"], heldout)
    m = c.models.draft
    metrics = spec_eval_hook(c, epoch=0, step=7)
    assert m.training  # train mode restored
    for key in ("spec/mean_accept_len", "spec/speedup", "spec/accept_rate_pos1", "spec/accept_rate_pos3",
                "spec/tokens_per_s", "spec/greedy_mismatches"):
        assert isinstance(metrics[key], float), key
    assert metrics["spec/greedy_mismatches"] == 0 and 1 <= metrics["spec/mean_accept_len"] <= 4
    data = json.loads((tmp_path / "eval" / "epoch-0" / "results.json").read_text())
    assert data["step"] == 7 and data["num_prompts"] == 2 and data["mean_accept_len"] == metrics["spec/mean_accept_len"]
    assert data["hf"] is None and len(data["batch_sweep"]) == 1


def test_hook_is_a_no_op_when_disabled(tok, tmp_path):
    c = _components(tok, tmp_path, ["eval.spec_eval=false"])
    t = time.perf_counter()
    assert spec_eval_hook(c, epoch=1, step=2) == {}
    assert time.perf_counter() - t < 0.1 and not (tmp_path / "eval").exists()
