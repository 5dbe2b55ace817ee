"""The one place that turns a config into objects: accelerator, target, draft, tokenizer, data, objective, optimizer."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
from omegaconf import DictConfig

from specdistill.config import Config, EvalConfig, TargetConfig, TrainerConfig
from specdistill.objectives import Models
from specdistill.objectives.base import Objective
from specdistill.phases import PhasePlan, plan_phases
from specdistill.optim import build_optimizer, check_optimizer_backend

if TYPE_CHECKING:  # annotations only: accelerate and the data package load when a run is built
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LambdaLR

    from specdistill.data.dataset import TokenizedData
    from specdistill.models.target import Target


@dataclass
class Components:
    """A built run: its objects, and only the parts of the config that the loop and its evaluations read (the stages
    after training, export and hub pushes, take the whole Config from the pipeline, which passes it to them)."""
    trainer: TrainerConfig  # the loop's settings
    eval: EvalConfig  # the held-out scoring (gamma, max_batches) and the speculative evaluations during training
    run_name: str  # the progress bar's and the tracker's name
    target_shard: str  # target.shard: a target split over the processes (fsdp) decodes every evaluation in step
    accelerator: Accelerator
    models: Models
    objective: Objective  # the main (last) phase's objective; a step trains phases.at(step).objective
    data: TokenizedData
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    output_dir: Path
    phases: PhasePlan  # the objective, data stream and LR of every step (one phase: `objective`)
    config_yaml: str  # the composed config, resolved: what <output_dir>/config.yaml and every checkpoint hold


def make_accelerator(t: TrainerConfig) -> Accelerator:
    from accelerate import Accelerator

    mp = t.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    kwargs = {}
    if t.wandb:
        os.environ.setdefault("WANDB_MODE", t.wandb_mode)
        kwargs["log_with"] = "wandb"
    from accelerate.utils import InitProcessGroupKwargs

    from specdistill.ranks import process_group_timeout

    # Used where this Accelerator initialises the process group (GPU launches); on CPU, distributed.py passes the same
    # timeout to the gloo group it initialises first.
    group = InitProcessGroupKwargs(timeout=process_group_timeout(t.process_group_timeout_s))
    return Accelerator(mixed_precision=mp, project_dir=t.output_dir, kwargs_handlers=[group], **kwargs)


def build_target(t: TargetConfig) -> Target:
    from specdistill.models.target import Target, load_causal_lm

    placement = "auto" if t.shard == "device_map" else None  # one process, its layers over the GPUs
    return Target(load_causal_lm(t.path, t.dtype, device_map=placement), t.aux_layer_ids)


def check_target_shard(target: TargetConfig, objectives: list[Optional[Objective]], processes: int) -> None:
    """target.shard against the launch and the objectives, before anything loads."""
    shard = target.shard
    if shard == "fsdp":
        if processes < 2:
            raise ValueError("target.shard=fsdp splits the target's layers over the processes of a launch and this "
                             "one has 1: launch N >= 2 (torchrun --nproc_per_node N, accelerate launch --num_processes "
                             "N), or use target.shard=none or device_map")
        rollouts = [o.name for o in objectives if o is not None and o.target_calls_depend_on_data]
        if rollouts:
            raise ValueError(f"target.shard=fsdp: objective {rollouts[0]} decodes with the target (rollouts), a "
                             "different number of target forwards on each process, and a sharded target runs them in "
                             "step: use target.shard=device_map (one process) or none")
    if shard == "device_map" and processes > 1:
        raise ValueError(f"target.shard=device_map spreads one process's target over all of the machine's GPUs, and "
                         f"this launch has {processes} processes that would each do so: launch one process, or use "
                         "target.shard=fsdp to split the target over the processes")


def place_target(shard: str, target: Target, accelerator: Accelerator) -> None:
    """Put the target where it runs: its layers split over the processes (target.shard=fsdp), then on this process's
    device; where device_map put it (target.shard=device_map)."""
    if shard == "device_map":
        return
    if shard == "fsdp":
        from specdistill.models.target import shard_target

        shard_target(target)
    target.to(accelerator.device)


def build_tokenizer(cfg: Config):
    from specdistill.models.target import load_tokenizer

    from specdistill.data.chat import set_chat_template

    tok = load_tokenizer(cfg.target.path)
    set_chat_template(tok, cfg.data.chat_template)  # data.chat_template replaces the tokenizer's, checked
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def feature_meta(target: TargetConfig, aux_layer_ids: Optional[list[int]], data: TokenizedData) -> dict:
    """What offline features depend on, by content (the target's files and dtype; the data's fingerprint covers its
    bytes and the tokenizer): checked when training reads them."""
    from specdistill.assets import model_digest

    return {"target": str(target.path), "target_files": model_digest(str(target.path)),
            "target_dtype": str(target.dtype), "aux_layer_ids": list(aux_layer_ids or []),
            "data": data.fingerprint}


def with_offline_features(cfg: Config, target: Target, data: TokenizedData):
    from specdistill.data.features import FeatureStore, WithFeatures

    store = FeatureStore(cfg.data.offline_dir)
    want = feature_meta(cfg.target, target.aux_layer_ids, data)
    if not target.aux_layer_ids:  # KD needs only the final hidden state: any aux ids will do
        want.pop("aux_layer_ids")
    store.check_matches(want)
    return WithFeatures(data.train, store)


def build(composed: DictConfig, accelerator: Optional[Accelerator] = None,
          make_data: Optional[Callable] = None) -> Components:
    """Components from a composed config (the door for code that composes with Hydra itself: tests, notebooks):
    checked and typed once (entry.load_config), then assembled."""
    from specdistill.entry import config_yaml, load_config

    cfg = load_config(composed, log=accelerator.print if accelerator is not None else print)
    return assemble(cfg, config_yaml(composed), accelerator, make_data)


def assemble(cfg: Config, config_yaml: str, accelerator: Optional[Accelerator] = None,
             make_data: Optional[Callable] = None) -> Components:
    """Components for a run of the checked config `cfg`. make_data(cfg, target, tokenizer, log, share) ->
    TokenizedData replaces reading cfg.data (the pipeline passes its regeneration stage when data.regenerate.enabled;
    build itself never regenerates); every process calls it, and share (ranks.folder_share) says how they split its
    work."""
    from torch.optim.lr_scheduler import LambdaLR

    from specdistill.data.dataset import build_data
    from specdistill.decoding import CacheMode
    from specdistill.drafts import kind_for_init, reads_draft_path
    from specdistill.drafts.readback import check_draft_tokenizer

    if cfg.draft.path and reads_draft_path(cfg.draft.init):  # a warm start from a corrupt draft is refused
        from specdistill.files import check_draft_folder

        check_draft_folder(cfg.draft.path, what="draft.path draft")
    objective = cfg.objective
    accelerator = accelerator or make_accelerator(cfg.trainer)
    torch.manual_seed(cfg.trainer.seed)
    log = accelerator.print
    check_target_shard(cfg.target, [objective, cfg.warmup.objective], accelerator.num_processes)
    check_optimizer_backend(cfg.trainer.optimizer, accelerator)
    regen = cfg.data.regenerate.enabled
    if regen and cfg.data.offline_dir:
        raise ValueError("data.regenerate.enabled=true writes its own features while decoding: set "
                         "data.offline_dir=null (or turn regeneration off to train from a dump_features.py folder)")
    if regen and make_data is None:
        raise ValueError("data.regenerate.enabled=true is a pipeline stage: run train.py (specdistill.pipeline.run), "
                         "or pass make_data=specdistill.pipeline.regenerate.build_regenerated_data to build()")
    draft_cfg = cfg.draft
    kind = kind_for_init(draft_cfg.init)
    objective.check_draft_kind(kind)  # e.g. draft-only rollouts of a draft that cannot decode alone: before loading
    from specdistill.models.target import load_target_config
    from specdistill.ranks import caches_filled_once

    with caches_filled_once(accelerator):  # an embedded target is converted here, once per cache folder
        target_config = load_target_config(cfg.target.path)  # config.json only: the draft's settings against it
    kind.check_config(draft_cfg, target_config)
    with caches_filled_once(accelerator):  # the converted target and the tokenized data: one writer per cache folder
        target = build_target(cfg.target)
        tokenizer = build_tokenizer(cfg)
        if regen or cfg.data.offline_dir:  # the target's files hashed for the cache keys: once per cache folder
            from specdistill.assets import model_digest

            model_digest(str(cfg.target.path))
        if not regen:
            data = build_data(cfg.data, tokenizer, log=log)
    if regen:  # the target answers real prompts, every process its share; its features are kept from the same forwards
        from specdistill.ranks import folder_share, in_step

        place_target(cfg.target.shard, target, accelerator)
        if kind.target_layers(draft_cfg, target.config):  # the layers a kind reads, captured while it decodes
            target.set_aux_layer_ids(kind.target_layers(draft_cfg, target.config))
        kind.prepare_target(target)
        # a sharded target's forwards are collective: every process then decodes every part, in step
        share = in_step(accelerator) if cfg.target.shard == "fsdp" else folder_share(accelerator)
        data = make_data(cfg, target, tokenizer, log=log, share=share)
    from specdistill.data.dataset import check_rows_fit
    from specdistill.decoding.kv import max_positions

    if not regen:  # regenerated rows are decoded within the target's positions (the decoder's check)
        check_rows_fit(data, max_positions(target.model), cfg.data.max_length)  # the evaluator's rule
    draft = kind.build(draft_cfg, target, data)
    if draft_cfg.init == "pretrained":
        check_draft_tokenizer(draft_cfg.path, tokenizer, log)  # or says that it is skipped
    if cfg.data.offline_dir:
        data.train = with_offline_features(cfg, target, data)
    place_target(cfg.target.shard, target, accelerator)

    t = cfg.trainer
    optimizer = build_optimizer(draft, t.optimizer, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay,
                                momentum=t.muon_momentum, muon_weight_decay=t.muon_weight_decay)
    plan = plan_phases(t, cfg.warmup, objective, data.train, tokenizer.pad_token_id, accelerator.process_index,
                       accelerator.num_processes)
    # One optimizer for every phase; the LR restarts per phase (phases.py). A plain function as the lambda: LambdaLR
    # then saves only its step counter, and the schedule comes from the config on resume.
    scheduler = LambdaLR(optimizer, lambda step: plan.lr_factor(step))
    draft, optimizer = accelerator.prepare(draft, optimizer)
    # Not prepared: accelerate's scheduler wrapper steps num_processes times per step; we step once per update.
    accelerator.register_for_checkpointing(scheduler)
    decoding = CacheMode(static=cfg.eval.static_cache, compile=cfg.eval.compile)  # rollouts decode as the evaluator
    return Components(t, cfg.eval, cfg.run_name, cfg.target.shard, accelerator,
                      Models(draft, target, tokenizer, decoding), objective, data, optimizer, scheduler,
                      Path(t.output_dir), plan, config_yaml)
