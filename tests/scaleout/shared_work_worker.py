"""One process of tests/scaleout/test_shared_work.py under `torchrun --nproc_per_node 2` (gloo on CPU).

argv: TARGET_DIR DATA_FILE WORK_DIR. Checks, each with an assert naming what broke:
  1. trainer.process_group_timeout_s reaches torch.distributed.init_process_group;
  2. regeneration into one folder both processes see: disjoint halves of the parts, a complete store equal to one
     process's; into node-local folders (one per process): each process fills its own folder whole; build() of a
     regenerating recipe shares it the same way;
  3. the final speculative evaluation split across the 2 processes gives the counts of one process on all prompts;
  4. target.shard=fsdp: the target's logits and aux hidden states equal the unsharded target's.
"""
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests` importable

from tests.conftest import compose, tiny_overrides  # noqa: E402

TARGET, DATA, WORK = map(Path, sys.argv[1:4])
AUX = [1, 2]


def main() -> None:
    torch.set_num_threads(1)
    seen = {}
    real_init = dist.init_process_group

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real_init(*args, **kwargs)

    dist.init_process_group = spy
    from specdistill.train.distributed import make_launch_accelerator

    over = tiny_overrides(TARGET, DATA, WORK / "out", WORK / "cache") + [
        "trainer.process_group_timeout_s=1234", "eval.num_prompts=5", "eval.max_new_tokens=8", "eval.gamma=3",
        "eval.batch_size=1", f"eval.prompts={DATA}", "eval.warmup_prompts=0", "eval.measure_cost=false"]
    from specdistill.entry import load_config

    composed = compose("kd", over)
    cfg = load_config(composed)
    acc = make_launch_accelerator(cfg.trainer)
    assert seen.get("timeout") == timedelta(seconds=1234), f"process group initialised with {seen}"
    rank = acc.process_index

    from specdistill.build import build

    c = build(composed, accelerator=acc)
    check_regeneration(acc, c.models.target.model, c.models.tokenizer)
    check_build_shares_regeneration(acc)
    check_spec_eval(acc, c)
    if "--no-shard" not in sys.argv:
        check_sharded_target(acc, cfg, c.models.tokenizer)
    acc.wait_for_everyone()
    print(f"[worker] rank {rank}: all checks passed", flush=True)


def check_regeneration(acc, model, tok) -> None:
    from accelerate.utils import gather_object

    from specdistill.config import RegenerateConfig
    from specdistill.data.regenerated import RegeneratedStore
    from specdistill.pipeline import regenerate as regen
    from specdistill.ranks import alone, folder_share

    written = []
    real_write = regen.write_part
    regen.write_part = lambda path, rows: (written.append(path.name), real_write(path, rows))[1]

    def run(store_dir, share):
        written.clear()
        cfg = RegenerateConfig(enabled=True, prompts=str(DATA), max_prompts=20, max_new_tokens=6, batch_size=4,
                               store_dir=str(store_dir))
        root, parts = regen.regenerate_store(cfg, model, tok, str(TARGET), AUX, log=lambda *_: None, progress=False,
                                             share=share)
        return root, parts, list(written)

    # one folder both processes see: each writes its own parts, together all of them, once
    root, parts, mine = run(WORK / "shared", folder_share(acc))
    every = gather_object([mine])
    assert parts == 5 and not set(every[0]) & set(every[1]) and len(every[0]) + len(every[1]) == 5, every
    shared = RegeneratedStore(root, parts)
    # node-local folders (one per process, as on two nodes): each process fills its own whole
    local_root, _, mine = run(WORK / f"node{acc.process_index}", folder_share(acc))
    assert len(mine) == 5, f"rank {acc.process_index} wrote {mine} into its node-local store"
    local = RegeneratedStore(local_root, parts)
    assert [local[i]["input_ids"] for i in range(len(local))] == [shared[i]["input_ids"] for i in range(len(shared))]
    if acc.is_main_process:  # one process alone gives the same rows and features
        alone_root, _, _ = run(WORK / "alone", alone)
        ref = RegeneratedStore(alone_root, parts)
        for i in range(len(ref)):
            assert ref[i]["input_ids"] == shared[i]["input_ids"], i
            torch.testing.assert_close(ref[i]["aux_hidden"].float(), shared[i]["aux_hidden"].float())
    acc.wait_for_everyone()
    regen.write_part = real_write
    print(f"[worker] rank {acc.process_index}: regeneration shared", flush=True)


def check_build_shares_regeneration(acc) -> None:
    """build() of a regenerating recipe hands the launch's share to the regeneration: each process decodes its own
    parts of the store (3 parts of 8 prompts: rank 0 parts 0 and 2, rank 1 part 1)."""
    from accelerate.utils import gather_object

    from specdistill.build import build
    from specdistill.pipeline import regenerate as regen

    written = []
    real_write = regen.write_part
    regen.write_part = lambda path, rows: (written.append(path.name), real_write(path, rows))[1]
    over = tiny_overrides(TARGET, DATA, WORK / "serve", WORK / "serve_cache") + ["trainer.epochs=null"]
    c = build(compose("eagle3_serve", over), accelerator=acc, make_data=regen.build_regenerated_data)
    regen.write_part = real_write
    every = gather_object([sorted(written)])
    assert every == [["part-00000.safetensors", "part-00002.safetensors"], ["part-00001.safetensors"]], every
    assert len(c.data.train) + len(c.data.heldout) == 24
    print(f"[worker] rank {acc.process_index}: build shared the regeneration", flush=True)


COUNTS = ("num_prompts", "new_tokens", "target_only_new_tokens", "target_forwards", "mean_accept_len",
          "accept_rate_per_pos", "reach_rate_per_pos", "accept_len_hist", "greedy_mismatches", "by_category")


def check_spec_eval(acc, c) -> None:
    from specdistill.decoding.kv import max_positions

    from specdistill.data.prompts import load_prompts
    from specdistill.eval.evaluator import evaluate, for_training
    from specdistill.train.spec_eval import run_spec_eval

    c.eval.spec_eval_at = "end"
    run_spec_eval(c, epoch=-1, step=0, name="final")
    if acc.is_main_process:
        merged = json.loads((c.output_dir / "eval" / "final" / "results.json").read_text())
        cfg = for_training(c.eval)
        prompts = load_prompts(cfg.prompts, c.models.tokenizer, num_prompts=cfg.num_prompts,
                               max_new_tokens=cfg.max_new_tokens, context=max_positions(c.models.target.model),
                               max_prompt_tokens=cfg.max_prompt_tokens)
        one = evaluate(c.models.target.model, c.models.tokenizer, acc.unwrap_model(c.models.draft), prompts, cfg,
                       progress=False, log=lambda *_: None).to_dict()
        for k in COUNTS:
            assert merged[k] == one[k], (k, merged[k], one[k])
        torch.testing.assert_close(torch.tensor(merged["alpha_per_pos"]), torch.tensor(one["alpha_per_pos"]))
        assert merged["env"]["processes"] == 2 and merged["num_prompts"] == 5
    acc.wait_for_everyone()
    print(f"[worker] rank {acc.process_index}: evaluation shared", flush=True)


def check_sharded_target(acc, cfg, tok) -> None:
    """target.shard=fsdp: every process holds part of the target's layers; outputs equal the whole target's, and a
    regeneration with it (every process decoding every part, in step) writes the same store."""
    from specdistill.build import build_target, place_target
    from specdistill.config import RegenerateConfig
    from specdistill.data.regenerated import RegeneratedStore
    from specdistill.pipeline.regenerate import regenerate_store
    from specdistill.ranks import in_step

    cfg.target.aux_layer_ids = AUX
    cfg.target.shard = "fsdp"
    whole = build_target(cfg.target)
    sharded = build_target(cfg.target)
    place_target(cfg.target.shard, sharded, acc)
    place_target(cfg.target.shard, sharded, acc)  # placing it again changes nothing
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in sharded.model.parameters())
    total = sum(p.numel() for p in whole.model.parameters())
    assert held < 0.8 * total, f"rank {acc.process_index} holds {held} of {total} target parameters"
    g = torch.Generator().manual_seed(acc.process_index)  # each process its own batch: the shards still serve it
    ids = torch.randint(3, whole.config.vocab_size, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    a, b = whole(ids, mask), sharded(ids, mask)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.aux_hidden, a.aux_hidden, atol=1e-5, rtol=1e-5)

    rcfg = RegenerateConfig(enabled=True, prompts=str(DATA), max_prompts=20, max_new_tokens=6, batch_size=4,
                            store_dir=str(WORK / "sharded_target"))
    root, parts = regenerate_store(rcfg, sharded.model, tok, str(TARGET), AUX, log=lambda *_: None, progress=False,
                                   share=in_step(acc))
    ref = RegeneratedStore(next((WORK / "shared").iterdir()), parts)
    got = RegeneratedStore(root, parts)
    assert [got[i]["input_ids"] for i in range(len(got))] == [ref[i]["input_ids"] for i in range(len(ref))]
    print(f"[worker] rank {acc.process_index}: sharded target holds {held} of {total} parameters, same outputs",
          flush=True)


if __name__ == "__main__":
    main()
