"""Bad DFlash settings are refused by name before anything loads: B < 2, a target layer id out of range, a mask token
outside the vocabulary (through the config, and when a draft is built directly)."""

import pytest

from specdistill.drafts.dflash import build_dflash
from specdistill.pipeline.run import build_components
from tests.conftest import compose, tiny_overrides
from tests.dflash.conftest import V, tiny_target


@pytest.mark.parametrize("override, key", [
    ("draft.dflash.block_size=1", "draft.dflash.block_size"),
    ("draft.dflash.target_layer_ids=[1,9]", "draft.dflash.target_layer_ids"),
    ("draft.dflash.target_layer_ids=[3,1]", "draft.dflash.target_layer_ids"),
    ("draft.dflash.mask_token_id=100000", "draft.dflash.mask_token_id"),
])
def test_bad_settings_are_refused_before_anything_loads(override, key, tiny_target_dir, tiny_data_file, tmp_path):
    cfg = compose("dflash_serve", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "out", tmp_path / "cache")
                  + [override])
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_components(cfg)
    assert not (tmp_path / "cache" / "regenerated").exists()  # nothing was decoded (nor loaded) first


@pytest.mark.parametrize("kw, key", [(dict(block_size=1), "block_size"),
                                     (dict(target_layer_ids=[0, 3]), "target_layer_ids"),
                                     (dict(mask_token_id=V), "mask_token_id")])
def test_a_directly_built_draft_refuses_them_too(kw, key):
    args = dict(block_size=4, target_layer_ids=None, mask_token_id=None) | kw
    with pytest.raises(ValueError, match=key):
        build_dflash(tiny_target(), 1, args["block_size"], args["target_layer_ids"], args["mask_token_id"])


def test_a_saved_draft_refuses_a_target_it_was_not_trained_for():
    from specdistill.drafts import draft_adapter
    from tests.dflash.conftest import tiny_dflash

    adapter = draft_adapter(tiny_dflash(tiny_target(), 4))
    adapter.check_target(tiny_target(), "same target")
    with pytest.raises(ValueError, match="layers"):
        adapter.check_target(tiny_target(layers=6), "a deeper target")


def test_dflash_serve_logs_throughput_flops_and_mfu_and_block_accuracy(tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.train.loop import fit

    cfg = compose("dflash_serve", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "out", tmp_path / "cache")
                  + ["trainer.epochs=null", "trainer.max_steps=2", "trainer.export_formats=[]",
                     "draft.dflash.block_size=4"])
    logged = fit(build_components(cfg)).history[-1]
    for key in ("train/tokens_per_s", "train/flops_per_token", "train/mfu", "train/acc_pos1",
                "train/acc_pos3"):
        assert key in logged, sorted(logged)
    assert logged["train/flops_per_token"] > 0
