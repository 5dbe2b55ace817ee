"""The rules behind sharing work across the processes of a launch, without launching any: the regeneration batch size
that follows the device, who fills which folder, which prompts each process evaluates, and which target.shard settings
a launch accepts. The 2-process runs are in tests/scaleout/test_shared_work.py."""
import pytest
from transformers import LlamaConfig

from specdistill.config import RegenerateConfig
from specdistill.eval.merge import shares
from specdistill.pipeline.regenerate import regeneration_batch_size, rows_that_fit
from specdistill.ranks import WorkShare, sharing_group
from tests.conftest import compose, make_tiny_lm

LLAMA_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256)
GB = 2**30


def test_the_regeneration_batch_follows_the_device():
    cfg = RegenerateConfig(batch_size=None)  # 256 prompt + 192 new tokens
    assert regeneration_batch_size(cfg, make_tiny_lm(64, layers=1, hidden=16)) == 16  # CPU: today's batch
    assert regeneration_batch_size(RegenerateConfig(batch_size=5), make_tiny_lm(64, layers=1, hidden=16)) == 5
    weights = 16 * GB  # an 8B target in bf16
    sizes = [rows_that_fit(LLAMA_8B, cfg, 2, weights, mem * GB) for mem in (24, 48, 80, 141)]
    assert sizes == sorted(sizes) and sizes[0] >= 1 and sizes[-1] <= 256
    assert sizes[-1] >= 64  # an H200 decodes far more than the CPU's 16 at once
    assert rows_that_fit(LLAMA_8B, RegenerateConfig(batch_size=None, max_new_tokens=2048), 2, weights, 141 * GB) < \
        sizes[-1]  # longer answers, fewer rows


def test_processes_that_see_one_folder_share_it_and_node_local_folders_are_filled_per_node():
    # 4 ranks on 2 nodes, node-local folders: ranks {0, 1} see each other's probes, {2, 3} theirs
    seen = [{0, 1}, {0, 1}, {2, 3}, {2, 3}]
    assert [sharing_group(seen, r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # a shared file system: one group; a probe shown late to one rank still gives every rank the same group
    assert sharing_group([{0, 1, 2}, {0, 1, 2}, {2}], 2) == [0, 1, 2]
    # each part goes to exactly one process of a group, whatever is already done
    owners = {i: [r for r in range(3) if i in WorkShare(r, 3).mine([1, 2, 4, 7, 8])] for i in (1, 2, 4, 7, 8)}
    assert all(len(o) == 1 for o in owners.values())


def test_evaluation_shares_are_whole_batches_covering_every_prompt_once():
    got = shares(7, 2, 2)
    assert got == [[0, 1, 4, 5], [2, 3, 6]]
    assert shares(3, 1, 4)[3] == []  # more processes than batches: one evaluates nothing
    assert sorted(sum(shares(11, 3, 3), [])) == list(range(11))


@pytest.mark.parametrize("shard, recipe, processes, error", [
    ("fsdp", "kd", 1, "this one has 1"),
    ("fsdp", "draft_opd", 2, "decodes with the target"),
    ("device_map", "kd", 2, "would each do so"),
    ("fsdp", "kd", 2, None),
    ("device_map", "kd", 1, None),
])
def test_target_shard_settings_a_launch_accepts(shard, recipe, processes, error, tiny_target_dir, tiny_data_file,
                                                tmp_path):
    from specdistill.build import check_target_shard
    from specdistill.entry import load_config
    from tests.conftest import ONPOLICY_ALONE, tiny_overrides

    over = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path, tmp_path) + [f"target.shard={shard}"]
    cfg = load_config(compose(recipe, over + (ONPOLICY_ALONE if recipe == "draft_opd" else [])), log=None)
    objectives = [cfg.objective, cfg.warmup.objective]
    if error is None:
        check_target_shard(cfg.target, objectives, processes)
    else:
        with pytest.raises(ValueError, match=error):
            check_target_shard(cfg.target, objectives, processes)


def test_device_map_loads_the_target_through_accelerate_placement(tiny_target_dir, tiny_data_file, tmp_path,
                                                                  monkeypatch):
    """target.shard=device_map: from_pretrained is asked to place the layers itself (device_map="auto"; here all on
    the CPU, the only device), and place_target leaves them where they are."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from specdistill.build import build_target, place_target
    from tests.conftest import tiny_overrides

    asked = {}
    real = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: asked.update(k) or real(cls, *a, **k)))
    over = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path, tmp_path) + ["target.shard=device_map"]
    cfg = compose("kd", over)
    target = build_target(cfg.target)
    assert asked.get("device_map") == "auto"
    # would move it if it were not left alone
    place_target(cfg.target.shard, target, SimpleNamespace(device=torch.device("meta")))
    assert all(p.device.type == "cpu" for p in target.model.parameters())


def test_the_accelerator_carries_the_process_group_timeout(tiny_target_dir, tiny_data_file, tmp_path):
    """On GPU launches the Accelerator initialises the process group with trainer.process_group_timeout_s (CPU
    launches: tests/scaleout/test_shared_work.py sees the value reach init_process_group)."""
    from datetime import timedelta

    from specdistill.build import make_accelerator
    from specdistill.entry import load_config
    from tests.conftest import tiny_overrides

    over = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path, tmp_path) + ["trainer.process_group_timeout_s=99"]
    acc = make_accelerator(load_config(compose("kd", over)).trainer)
    assert acc.init_handler.to_kwargs()["timeout"] == timedelta(seconds=99)
