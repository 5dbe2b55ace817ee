"""DFlash under bf16 autocast (trainer.mixed_precision=bf16, as a GPU's `auto` picks): recipe dflash_serve and
recipe=draft_opd draft=dflash train with finite losses, the first step within 5% of the fp32 run's."""
import pytest

from tests.conftest import assert_bf16_near_fp32

STEPS = ["trainer.max_steps=2", "trainer.lr=3e-3", "trainer.warmup_steps=0", "trainer.export_formats=[]",
         "trainer.measure_roofline=false", "draft.dflash.block_size=4", "draft.draft_vocab_size=96"]
RUNS = {
    "dflash_serve": ("dflash_serve", ["trainer.epochs=null"]),
    "draft_opd_dflash": ("draft_opd", [  # 1 warm-up step (dflash), the hand-over, 1 on-policy step
        "draft=dflash", "objective.max_new_tokens=6", "objective.gamma=3", "objective.replay_ratio=0.5",
        "warmup.steps=1", "warmup.epochs=null", "warmup.micro_batch_size=2", "warmup.warmup_steps=0",
        "trainer.max_steps=1"]),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_dflash_trains_under_bf16_autocast_near_its_fp32_run(name, tiny_target_dir, tiny_data_file, tmp_path):
    recipe, extra = RUNS[name]
    assert_bf16_near_fp32(recipe, tiny_target_dir, tiny_data_file, tmp_path, STEPS + extra)
