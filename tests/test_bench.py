"""The recipe benchmark's variant table: each variant's draft kind comes from its composed config, and a trained
variant is re-evaluated from its saved draft through that kind's adapter (no model is loaded here)."""
from argparse import Namespace

import pytest

from specdistill.cli import bench


def _args(tmp_path):
    return Namespace(target="some/target", data="data.jsonl", max_rows=8, max_length=64, seed=0, micro_batch_size=1,
                     grad_accum=1, out=str(tmp_path), lr=None, override=[])


@pytest.mark.parametrize("name, recipe, init", [("kd", "kd", "pretrained"), ("draft_opd", "kd", "pretrained"),
                                                ("eagle3", "eagle3", "eagle3"),
                                                ("draft_opd_eagle3", "eagle3", "eagle3")])
def test_a_variant_is_reevaluated_from_its_saved_draft_by_its_kind(name, recipe, init, tmp_path):
    got, overrides = bench.reeval_recipe(_args(tmp_path), name, {"checkpoint": str(tmp_path / "ck")})
    assert got == recipe
    cfg = bench.compose(got, overrides)
    assert cfg.draft.init == init and cfg.draft.path == str(tmp_path / "ck" / "draft")
