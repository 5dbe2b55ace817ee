"""Draft-OPD's rollout acceptance by output position: rollout_accept_bucket_<start>_<end> (accepted / proposed drafts
of the rounds that started in the bucket), from the evaluator's counting function (specdistill.output_positions)."""
import copy

import pytest
import torch

from specdistill.models.target import Target
from specdistill.objectives import Models
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.train.loop import ratios
from tests.onpolicy.conftest import tiny_lm


def _batch(rows: int = 2):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 48, (rows, 8), generator=g)
    lm = torch.zeros_like(ids)
    lm[:, 4:] = 1  # prompts of 4 tokens
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}


def _bucket_metrics(metrics: dict) -> dict[str, tuple[float, float]]:
    names = {k.removeprefix("rollout_accept_bucket_").removesuffix("_sum") for k in metrics
             if k.startswith("rollout_accept_bucket_") and k.endswith("_sum")}
    return {n: (float(metrics[f"rollout_accept_bucket_{n}_sum"]), float(metrics[f"rollout_accept_bucket_{n}_count"]))
            for n in names}


@pytest.mark.parametrize("max_new, buckets", [(10, {"0_127"}), (140, {"0_127", "128_255"})])
def test_a_draft_opd_step_logs_acceptance_per_bucket_of_output_position(max_new, buckets):
    target = tiny_lm(0)
    models = Models(tiny_lm(1, layers=1).train(), Target(target))
    obj = DraftOPDObjective(gamma=3, max_new_tokens=max_new, temperature=0.0, replay=False)
    out = obj(_batch(), models)
    got = _bucket_metrics(out.metrics)
    assert set(got) == buckets  # the buckets a rollout of max_new tokens can reach, and no others
    stats = obj.state.fresh.stats
    # accepted drafts add up to the positions' own count (positions_from_rounds), proposed to every drafted round
    assert sum(a for a, _ in got.values()) == stats.accepted
    assert all(0 <= a <= p and p > 0 for a, p in got.values())
    assert sum(p for _, p in got.values()) >= stats.drafted
    logged = ratios({k: float(v) for k, v in out.metrics.items()}, 1.0)
    for n, (a, p) in got.items():
        assert logged[f"train/rollout_accept_bucket_{n}"] == pytest.approx(a / p)


def test_the_target_drafting_for_itself_accepts_every_draft_in_every_bucket():
    target = tiny_lm(0)
    models = Models(copy.deepcopy(target).train(), Target(target))
    obj = DraftOPDObjective(gamma=3, max_new_tokens=140, temperature=0.0, replay=False)
    got = _bucket_metrics(obj(_batch(), models).metrics)
    assert set(got) == {"0_127", "128_255"}
    # every row-round drafts gamma except where the budget cuts it; all accepted
    assert all(a == p > 0 for a, p in got.values())
    rounds = obj.state.fresh.stats.output_buckets
    assert [b.name for b in rounds][:2] == ["0_127", "128_255"]
    assert int(rounds[0].rounds.sum()) == 2 * 32  # offsets 0, 4, .., 124: 32 rounds per row start below 128
