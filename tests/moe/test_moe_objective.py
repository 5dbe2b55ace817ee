"""moe_kd: the expert-level loss is zero when draft experts equal their sources, positive otherwise, and trains
only expert weights; the recipe trains a few steps on tiny Mixtral and Qwen3-MoE targets."""

import pytest
import torch

from specdistill.build import build
from specdistill.models.target import Target
from specdistill.moe.build import build_moe_draft
from specdistill.moe.profiler import profile_routing
from specdistill.objectives import Models
from specdistill.objectives.moe_kd import MoEKDObjective
from specdistill.train.loop import fit
from tests.conftest import compose, tiny_overrides
from tests.moe.conftest import random_batch
from tests.test_recorded_losses import check_recorded


def _draft(target, kind):
    kept = {0: [0, 1, 3], 1: [1, 2, 3]}
    prof = profile_routing(target, [random_batch(target.config.vocab_size, seed=5)])
    return build_moe_draft(target, [0, 1], kept, kind=kind, profile=prof)


def _expert_only(target, draft, batch):
    obj = MoEKDObjective(kd_weight=0.0, expert_weight=1.0)
    return obj(batch, Models(draft.train(), Target(target)))


def test_expert_loss_is_zero_when_draft_experts_equal_their_sources(tiny_moe):
    batch = random_batch(tiny_moe.config.vocab_size)
    out = _expert_only(tiny_moe, _draft(tiny_moe, "moe"), batch)
    n = int(batch["loss_mask"].sum())
    assert out.loss.shape == (n,)
    assert torch.equal(out.loss, torch.zeros(n))
    share = out.metrics["kept_routing_share_sum"] / n
    assert 0 < share < 1  # some routing weight lands on dropped experts


def test_expert_loss_grows_with_a_perturbed_expert_and_trains_only_experts(tiny_moe):
    batch = random_batch(tiny_moe.config.vocab_size)
    draft = _draft(tiny_moe, "moe")
    with torch.no_grad():
        draft.model.layers[1].mlp.experts.down_proj[2] += 0.1  # draft expert 2 of layer 1 = target expert 3
    out = _expert_only(tiny_moe, draft, batch)
    assert out.loss.sum() > 0
    out.loss.sum().backward()
    grads = {k for k, p in draft.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == {"model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"}
    ex = draft.model.layers[1].mlp.experts
    for p in (ex.down_proj, ex.gate_up_proj):  # only the perturbed expert moves; the others already match
        assert p.grad[[0, 1]].abs().sum() == 0 and p.grad[2].abs().sum() > 0


def test_dense_draft_expert_loss_matches_the_block(tiny_moe):
    batch = random_batch(tiny_moe.config.vocab_size)
    out = _expert_only(tiny_moe, _draft(tiny_moe, "dense"), batch)
    assert out.loss.sum() > 0 and torch.isfinite(out.loss).all()  # distinct experts: a merge is not the block


def test_full_objective_metrics(tiny_moe):
    batch = random_batch(tiny_moe.config.vocab_size)
    out = MoEKDObjective()(batch, Models(_draft(tiny_moe, "moe"), Target(tiny_moe)))
    keys = {"loss_sum", "kd_sum", "expert_sum", "alpha_sum", "target_top1_agree", "kept_routing_share_sum"}
    assert keys <= set(out.metrics)
    assert torch.allclose(out.metrics["loss_sum"], out.metrics["kd_sum"] + out.metrics["expert_sum"])


def test_moe_kd_refuses_drafts_without_provenance(tiny_moe):
    import copy

    draft = copy.deepcopy(tiny_moe)
    with pytest.raises(ValueError, match="moe_experts"):
        MoEKDObjective()(random_batch(tiny_moe.config.vocab_size), Models(draft, Target(tiny_moe)))


@pytest.mark.parametrize("kind,draft", [("mixtral", "moe_experts"), ("qwen3_moe", "moe_experts"),
                                        ("mixtral", "moe_dense")])
def test_moe_kd_recipe_trains_on_a_tiny_moe_target(kind, draft, tiny_moe_dirs, tiny_data_file, tmp_path):
    out = tmp_path / "run"
    cfg = compose("moe_kd", tiny_overrides(tiny_moe_dirs[kind], tiny_data_file, out, tmp_path / "cache")
                  + [f"draft={draft}", "draft.num_layers=2", "draft.moe.num_experts=2", "draft.moe.coverage=null",
                     "draft.moe.profile_batches=2", "trainer.lr=3e-3", "trainer.max_steps=3"])
    c = build(cfg)
    meta = c.models.draft.config.specdistill_moe
    assert meta["source_layers"] == [0, 1] and all(len(e) == 2 for e in meta["experts"])
    res = fit(c)
    assert res.step == 3
    check_recorded(f"moe_kd[{kind}-{draft}]", [x["train/loss"] for x in res.history])  # tests/test_recorded_losses.py
    h = res.history[-1]
    assert all(torch.isfinite(torch.tensor(x["train/loss"])) for x in res.history)
    assert "train/expert" in h and "train/kd" in h and 0 < h["train/kept_routing_share"] <= 1
    from specdistill.drafts import load_trained_draft
    reloaded = load_trained_draft(res.final_checkpoint / "draft")
    assert reloaded.config.specdistill_moe["experts"] == meta["experts"]
    sd = c.accelerator.unwrap_model(c.models.draft).state_dict()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_saved_profile_drives_the_draft_and_eagle3_mlp(tiny_moe_dirs, tiny_data_file, tmp_path):
    from specdistill.moe.profiler import RoutingProfile

    d = tiny_moe_dirs["mixtral"]
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(d)
    prof = profile_routing(target, [random_batch(target.config.vocab_size)])
    path = prof.save(tmp_path / "profile.json")
    over = tiny_overrides(d, tiny_data_file, tmp_path / "e3", tmp_path / "cache")
    cfg = compose("eagle3", over + ["draft.moe.eagle3_mlp=true", f"draft.moe.profile={path}", "draft.moe.num_experts=3",
                                    "draft.moe.coverage=null", "draft.draft_vocab_size=64"])
    c = build(cfg)
    I = target.config.intermediate_size
    head = c.accelerator.unwrap_model(c.models.draft)
    assert head.config.intermediate_size == 3 * I
    assert RoutingProfile.load(path).layers == [0, 1, 2]


@pytest.mark.parametrize("name", ["moe_kd", "moe_opd"])
def test_objective_yaml_mirrors_the_dataclass(name):
    import dataclasses

    from omegaconf import OmegaConf

    from specdistill.config import CONF_DIR
    from specdistill.objectives import OBJECTIVES

    yaml = OmegaConf.load(CONF_DIR / "objective" / f"{name}.yaml")
    assert dict(yaml) == {f.name: f.default for f in dataclasses.fields(OBJECTIVES[name])}


def test_moe_opd_recipe_trains_on_a_tiny_moe_target(tiny_moe_dirs, tiny_data_file, tmp_path):
    out = tmp_path / "opd"
    cfg = compose("moe_opd", tiny_overrides(tiny_moe_dirs["mixtral"], tiny_data_file, out, tmp_path / "cache")
                  + ["draft.num_layers=2", "draft.moe.num_experts=2", "draft.moe.coverage=null",
                     "draft.moe.profile_batches=2", "objective.max_new_tokens=6", "objective.gamma=2",
                     "trainer.max_steps=2", "trainer.grad_accum=1"])
    c = build(cfg)
    res = fit(c)
    assert res.step == 2
    check_recorded("moe_opd", [x["train/loss"] for x in res.history])  # tests/test_recorded_losses.py
    h = res.history[-1]
    assert torch.isfinite(torch.tensor(h["train/loss"])) and h["train/expert"] >= 0
    assert "train/onpolicy_loss" in h and 0 < h["train/kept_routing_share"] <= 1
