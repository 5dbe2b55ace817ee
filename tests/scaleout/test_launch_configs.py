"""conf/accelerate/: every launcher file parses with accelerate's config loader and is as named."""
import json

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from tests.scaleout.conftest import REPO

CONF = REPO / "conf" / "accelerate"
EXPECTED = {"single_gpu": ("NO", 1), "ddp": ("MULTI_GPU", None), "fsdp": ("FSDP", None),
            "deepspeed_zero2": ("DEEPSPEED", None), "deepspeed_zero3_offload": ("DEEPSPEED", None),
            "multi_node": ("MULTI_GPU", None)}


def test_every_launch_mode_has_a_file():
    assert {p.stem for p in CONF.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_launch_config_parses(name):
    cfg = load_config_from_file(str(CONF / f"{name}.yaml"))
    kind, n = EXPECTED[name]
    assert str(cfg.distributed_type).endswith(kind)
    if n is not None:
        assert cfg.num_processes == n
    if name == "fsdp":
        assert cfg.fsdp_config["fsdp_version"] == 2
    if name == "deepspeed_zero2":
        assert cfg.deepspeed_config["zero_stage"] == 2
    if name == "deepspeed_zero3_offload":
        ds = json.loads((REPO / cfg.deepspeed_config["deepspeed_config_file"]).read_text())
        z = ds["zero_optimization"]
        assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
        assert z["stage3_gather_16bit_weights_on_model_save"]  # the full HF draft is written at each checkpoint
        assert ds["gradient_accumulation_steps"] == 1  # the loop accumulates
    if name == "multi_node":
        assert cfg.num_machines == 2 and cfg.main_process_port


def test_readme_scale_out_commands_use_existing_files():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Scale-out"):]
    section = section[: section.index("\n## ", 5)] if "\n## " in section[5:] else section
    for name in EXPECTED:
        assert f"conf/accelerate/{name}.yaml" in section, name
