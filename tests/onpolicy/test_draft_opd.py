"""The draft_opd objective: weights from the verifier's alphas, its own token count, replay re-scoring with cached
target logits, config errors, and the recipe (with each ablation switch) training through the one loop."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from specdistill.objectives import make_objective
from specdistill.losses import divergence
from specdistill.models.target import Target
from specdistill.objectives import Models
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.onpolicy.rollout import FIRST_REJECTED
from specdistill.onpolicy.weights import reach_weights
from tests.conftest import ONPOLICY_ALONE, compose, tiny_overrides
from tests.onpolicy.conftest import CountingTarget, perturb, tiny_lm


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 48, (3, 10), generator=g)
    am = torch.ones_like(ids)
    am[1, 7:] = 0
    lm = torch.zeros_like(ids)
    lm[0, 4:9], lm[1, 2:6], lm[2, 6:9] = 1, 1, 1   # prompts of 5, 3 and 7 tokens
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm}


def _models(seed_draft=1):
    return Models(tiny_lm(seed_draft, layers=1).train(), CountingTarget(tiny_lm(0)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_weights_are_products_of_the_verifiers_alphas(temperature):
    models = _models()
    obj = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=temperature, replay=False, weighting="reach")
    batch = _batch()
    prep = obj.prepare(batch, models)
    n = obj.num_tokens(prep)
    out = obj.loss(prep, models)
    fresh = obj.state.fresh
    assert obj.state.refreshes == 1 and int(n) == len(out.loss) == len(fresh)  # the loop's count is what loss() returns
    # fresh rollout, unchanged draft: the current alphas are the ones the verifier used
    expected = reach_weights(fresh.alpha, fresh.round_id, fresh.index)
    assert torch.allclose(out.weight, expected, atol=1e-5)
    assert out.loss.requires_grad and not out.weight.requires_grad
    if temperature == 0:  # greedy: a position is reached iff every earlier draft of its round was accepted
        assert set(out.weight.tolist()) <= {0.0, 1.0}
    out.loss.mul(out.weight).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in models.draft.parameters())


def test_replayed_positions_are_rescored_by_the_current_draft_from_cached_target_logits():
    models = _models()
    obj = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=1.0, replay=True, replay_ratio=0.5,
                            replay_weight=0.3, divergence="rkl:1.0,tvd:0.5")
    obj(_batch(), models)
    missed = int((obj.state.fresh.category == FIRST_REJECTED).sum())  # replay keeps the verifier's rejections
    assert len(obj.state.buffer) == missed > 0
    # trajectory prefixes
    assert all(any(torch.equal(r[: len(it.context)], it.context) for r in obj.state.fresh.rows[:3])
               for it in obj.state.buffer.items.values())
    perturb(models.draft)  # the draft changes between the two calls
    b2 = _batch()
    prep = obj.prepare(b2, models)
    calls_before = models.target.calls
    items = prep.replay
    out = obj.loss(prep, models)
    obj.end_step()  # the replay buffer takes the step's updates
    assert models.target.calls == calls_before  # nothing recomputed on the target for replayed positions
    P, Q = len(obj.state.fresh), len(items)
    assert Q == min(round(0.5 * P), missed) and len(out.loss) == P + Q
    assert torch.allclose(out.weight[P:], torch.full((Q,), 0.3))
    with torch.no_grad():
        for k, it in enumerate(items):
            q = models.draft(it.context[None]).logits[:, -1]
            p = it.target.dense()
            want = divergence("rkl", p, q) + 0.5 * divergence("tvd", p, q)
            assert torch.allclose(out.loss[P + k], want[0], atol=1e-4)
            if it.uid in obj.state.buffer.items:  # priority refreshed to 1 - alpha under the current draft
                alpha = torch.minimum(p.softmax(-1), q.softmax(-1)).sum()
                assert obj.state.buffer.items[it.uid].priority == pytest.approx(1 - float(alpha), abs=1e-5)
    assert float(out.metrics["replay_used_sum"]) == Q


def test_rollouts_refresh_every_n_calls():
    models = _models()
    obj = DraftOPDObjective(gamma=2, max_new_tokens=6, temperature=1.0, rollout_every=2, replay=False)
    for _ in range(4):
        out = obj(_batch(), models)
    assert obj.state.calls == 4 and obj.state.refreshes == 2
    assert "rollout_tau_sum" not in out.metrics  # the 4th call reused the 3rd call's rollout


@pytest.mark.parametrize("bad, match", [({"gamma": 0}, "gamma"), ({"replay_ratio": 1.5}, "replay_ratio"),
                                        ({"divergence": "kl"}, "divergence"), ({"weighting": "x"}, "weighting"),
                                        ({"max_new_tokens": 1}, "max_new_tokens"), ({"gamam": 3}, "gamam")])
def test_bad_config_fails_before_loading_anything(bad, match):
    with pytest.raises(ValueError, match=match):
        make_objective({"name": "draft_opd", **bad})


def test_bad_models_fail_at_the_first_call():
    obj = DraftOPDObjective(gamma=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="vocab"):
        obj(_batch(), Models(tiny_lm(1, vocab=40), Target(tiny_lm(0))))
    sharded = tiny_lm(1, layers=1)
    next(sharded.parameters()).ds_id = 0  # how DeepSpeed ZeRO-3 marks its partitioned parameters
    with pytest.raises(ValueError, match="whole draft"):
        DraftOPDObjective(gamma=2, max_new_tokens=4)(_batch(), Models(sharded, Target(tiny_lm(0))))
    batch = _batch()
    batch["attention_mask"][0] = 0
    with pytest.raises(ValueError, match="no tokens"):
        DraftOPDObjective(gamma=2, max_new_tokens=4)(batch, _models())


ABLATIONS = [[], ["objective.assist=false", "objective.temperature=0"],
             ["objective.replay=false", "objective.weighting=none", "objective.off_trajectory=drop",
              "objective.kd_weight=0.5", "objective.target_top_k=16"],
             ["draft=eagle3", "objective.weighting=decay", "objective.kd_weight=0.5", "objective.rollout_scope=step",
              "trainer.grad_accum=2"]]


@pytest.mark.parametrize("switches", ABLATIONS,
                         ids=["full", "no_assist", "no_replay_no_weighting_kd", "eagle3_step_rollout"])
def test_recipe_trains_with_each_switch(switches, tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.build import build
    from specdistill.train.loop import fit

    cfg = compose("draft_opd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "cache")
                  + ONPOLICY_ALONE + ["trainer.max_steps=2", "objective.max_new_tokens=8", "objective.gamma=3"]
                  + switches)
    c = build(cfg)
    before = {k: v.clone() for k, v in c.models.draft.state_dict().items()}
    res = fit(c)
    last = res.history[-1]
    assert res.step == 2 and torch.isfinite(torch.tensor(last["train/loss"]))
    assert 0 <= last["train/rollout_accept_rate"] <= 1 and 1 <= last["train/rollout_tau"] <= 4
    assert ("train/replay_size" in last) == ("objective.replay=false" not in switches)
    assert ("train/kd_loss" in last) == ("objective.kd_weight=0.5" in switches)
    assert any(not torch.equal(v, before[k]) for k, v in c.models.draft.state_dict().items())
    lines = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/rollout_target_tokens" in x for x in lines)
    assert c.objective.state.target_tokens_total > 0
    accum, step_scope = cfg.trainer.grad_accum, "objective.rollout_scope=step" in switches
    assert accum == 2 and c.objective.state.calls == 2 * accum
    assert c.objective.state.refreshes == (2 if step_scope else 2 * accum)  # a step's rollout: one per step


def test_warm_start_from_a_kd_checkpoint(tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.build import build
    from specdistill.train.loop import fit

    base = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "kd", tmp_path / "cache")
    kd = fit(build(compose("kd", base + ["trainer.max_steps=1"])))
    path = kd.final_checkpoint / "draft"
    cfg = compose("draft_opd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "opd", tmp_path / "cache")
                  + ONPOLICY_ALONE + ["trainer.max_steps=1", "objective.max_new_tokens=6", "draft=pretrained",
                                      f"draft.path={path}"])
    c = build(cfg)
    from specdistill.drafts import load_trained_draft
    warm = load_trained_draft(path).state_dict()
    assert all(torch.equal(v, warm[k]) for k, v in c.models.draft.state_dict().items())
    assert fit(c).step == 1


def test_prompt_only_source_feeds_the_rollouts(tmp_path):
    from specdistill.data.chat import prompt_ids
    from tests.conftest import make_tiny_lm, make_tokenizer

    tok = make_tokenizer()
    texts = ["tell me about the cat", "what is one two three", "hello"]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))  # prompts only: no completion anywhere
    target, draft = make_tiny_lm(len(tok), layers=2, seed=0), make_tiny_lm(len(tok), layers=1, seed=1)
    models = Models(draft, Target(target), tok)
    obj = DraftOPDObjective(gamma=2, max_new_tokens=6, prompts=str(f), replay=False)
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long),
             "loss_mask": torch.zeros(2, 4, dtype=torch.long)}
    want = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts + texts]
    for call in range(3):  # 2 rows per call, cycling through the 3 prompts
        obj(batch, models)
        for b in range(2):
            assert obj.state.fresh.rows[b][: len(want[2 * call + b])].tolist() == want[2 * call + b]


def test_yaml_mirrors_the_dataclass():
    import dataclasses

    from specdistill.config import CONF_DIR

    yaml = OmegaConf.load(CONF_DIR / "objective" / "draft_opd.yaml")
    fields = {f.name: f.default for f in dataclasses.fields(DraftOPDObjective)}
    assert dict(yaml) == fields


SMALL_LM = ["draft=small_lm", "draft.hidden_size=16", "draft.intermediate_size=32", "draft.num_attention_heads=2",
            "draft.num_key_value_heads=1"]


@pytest.fixture(scope="module")
def peaked_target_dir(tmp_path_factory):
    """The tiny target with its head weights x20: peaked distributions, so at temperature 1 a fresh draft's sampled
    tokens are often rejected (with the plain tiny target both are near uniform and nearly everything is accepted)."""
    from tests.conftest import make_tiny_lm, make_tokenizer

    d = tmp_path_factory.mktemp("peaked_target")
    tok = make_tokenizer()
    model = make_tiny_lm(len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft", [SMALL_LM, ["draft=eagle3"]], ids=["lm", "eagle3"])
def test_resume_equals_uninterrupted_with_replay_and_a_cached_rollout(draft, temperature, tiny_target_dir,
                                                                       peaked_target_dir, tiny_data_file, tmp_path):
    """The replay buffer (EAGLE-3: with its cached target features), the rollout RNG and a rollout cached across the
    checkpoint (rollout_every=3 with 2 calls per step) are saved per rank: the resumed run ends with the
    uninterrupted run's weights and buffer. At temperature 1 (the default) the rollouts after the checkpoint are
    sampled (drafts, acceptance draws, resampled tokens), so they match only if the rollout RNG's state was restored."""
    from specdistill.build import build
    from specdistill.train.checkpoint import list_checkpoints
    from specdistill.train.loop import fit

    target = peaked_target_dir if temperature > 0 else tiny_target_dir

    def run(name, extra=()):
        cfg = compose("draft_opd", tiny_overrides(target, tiny_data_file, tmp_path / name, tmp_path / "cache")
                      + ONPOLICY_ALONE + ["trainer.max_steps=4", "trainer.save_every=2", "trainer.keep_checkpoints=5",
                         "trainer.grad_accum=2", "trainer.micro_batch_size=1", "objective.max_new_tokens=6",
                         "objective.gamma=3", "objective.rollout_every=3", "objective.replay_ratio=0.5",
                         f"objective.temperature={temperature}",
                         "trainer.lr=5e-3"] + draft + list(extra))
        c = build(cfg)
        return c, fit(c)

    full, _ = run("full")
    assert len(full.objective.state.buffer) > 0
    ckpt = list_checkpoints(tmp_path / "full")[0]
    assert (ckpt / "state" / "objective_0.pt").exists()
    resumed, res = run("resumed", [f"trainer.resume={ckpt}"])
    assert res.step == 4
    pf = full.models.draft.state_dict()
    for k, v in resumed.models.draft.state_dict().items():
        assert torch.allclose(v, pf[k], atol=1e-6), k
    assert resumed.objective.state.calls == full.objective.state.calls
    assert resumed.objective.state.refreshes == full.objective.state.refreshes
    assert sorted(full.objective.state.buffer.items) == sorted(resumed.objective.state.buffer.items)
    torch.testing.assert_close(resumed.objective.state.buffer.priorities(), full.objective.state.buffer.priorities())
    for u, it in full.objective.state.buffer.items.items():
        back = resumed.objective.state.buffer.items[u]
        assert torch.equal(back.context, it.context) and back.index == it.index
        assert (back.aux is None) == (it.aux is None) and (it.aux is None or torch.equal(back.aux, it.aux))


def test_a_steps_micro_batches_see_the_replay_buffer_as_the_step_began():
    """The loop prepares and backpropagates one micro-batch at a time; the buffer's updates wait for end_step(), so
    the second micro-batch of a step samples the buffer the first one saw (as when every micro-batch was prepared
    before any loss), and config and state stay apart."""
    models = _models()
    obj = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=1.0, replay=True, replay_ratio=0.5)
    first = obj.prepare(_batch(), models)
    obj.loss(first, models)
    assert len(obj.state.buffer) == 0 and len(obj.state.pending) == 1  # deferred
    second = obj.prepare(_batch(), models)
    assert second.replay == []  # the buffer was empty when the step began
    obj.loss(second, models)
    metrics = obj.end_step()
    assert len(obj.state.buffer) > 0 and obj.state.pending == [] and float(metrics["replay_size_count"]) == 2
    assert "state" not in {f.name for f in __import__("dataclasses").fields(obj)}
    assert obj.num_tokens_before_prepare(_batch()) is None  # counted after the rollout: the loop rescales


def test_the_state_round_trips_through_state_dict():
    models = _models()
    obj = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=1.0, replay=True, replay_ratio=0.5)
    obj(_batch(), models)
    saved = obj.state_dict()
    back = DraftOPDObjective(gamma=3, max_new_tokens=10, temperature=1.0, replay=True, replay_ratio=0.5)
    back.load_state_dict(saved)
    assert (back.state.calls, back.state.refreshes) == (obj.state.calls, obj.state.refreshes)
    assert sorted(back.state.buffer.items) == sorted(obj.state.buffer.items)
    assert torch.equal(back.state.generator_state, obj.state.generator.get_state())


@pytest.mark.parametrize("max_elements", [1, 7 * 40, 3 * 7 * 40 + 5, 10 ** 9, None])
def test_row_blocks_give_the_whole_batchs_alphas(max_elements):
    """The detached alphas computed a block of rows at a time equal one call over every row, whatever the block."""
    from specdistill.drafts.base import min_sum_on_draft_vocab
    from specdistill.objectives.draft_opd import by_row_blocks

    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(23, 40, generator=g) * 3, torch.randn(23, 30, generator=g) * 3
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[torch.randperm(40, generator=g)[:30]] = True
    fn = lambda a, b: min_sum_on_draft_vocab(a, b, t2d, 1.0, 0.0)  # noqa: E731
    got = by_row_blocks(fn, p, q, max_elements)
    assert got.shape == (23,) and torch.equal(got, fn(p, q))
    assert by_row_blocks(fn, p[:0], q[:0], max_elements).shape == (0,)
