"""The one place that turns a config into objects: accelerator, target, draft, tokenizer, data, objective, optimizer."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.config import validate_objective


@dataclass
class Components:
    cfg: DictConfig
    accelerator: Any
    models: Any  # objectives.Models
    objective: Any
    data: Any  # data.dataset.TokenizedData
    optimizer: torch.optim.Optimizer
    scheduler: Any
    output_dir: Path


def make_accelerator(cfg: DictConfig):
    from accelerate import Accelerator

    mp = cfg.trainer.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    kwargs = {}
    if cfg.trainer.wandb:
        os.environ.setdefault("WANDB_MODE", cfg.trainer.wandb_mode)
        kwargs["log_with"] = "wandb"
    return Accelerator(mixed_precision=mp, project_dir=cfg.trainer.output_dir, **kwargs)


def build_target(cfg: DictConfig):
    from specdistill.models.target import Target, load_causal_lm

    return Target(load_causal_lm(cfg.target.path, cfg.target.dtype), cfg.target.aux_layer_ids)


def build_tokenizer(cfg: DictConfig):
    from specdistill.models.target import load_tokenizer

    tok = load_tokenizer(cfg.target.path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_eagle3_draft(draft_cfg, target, data):
    """An EAGLE-3 head for `target`; sets the target to return the head's aux hidden states from its forward."""
    from specdistill.models.eagle3 import Eagle3Head, build_eagle3, frequent_token_vocab

    if draft_cfg.path:
        head = Eagle3Head.from_pretrained(draft_cfg.path)
        if head.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"EAGLE-3 head at {draft_cfg.path} was made for vocab {head.config.vocab_size}, the target "
                             f"has {target.config.vocab_size}: warm-start only from a head trained for this target")
    else:
        vocab = frequent_token_vocab(data.train, target.config.vocab_size, draft_cfg.draft_vocab_size)
        head = build_eagle3(target.model, vocab, target.aux_layer_ids, draft_cfg.output_from_target)
        if draft_cfg.moe.eagle3_mlp:  # MoE targets: the MLP starts as a merge of hot experts (specdistill/moe)
            from specdistill.moe.draft import init_eagle3_from_config
            init_eagle3_from_config(head, draft_cfg, target.model, data)
    target.set_aux_layer_ids(head.config.aux_layer_ids)
    return head.train()


def feature_meta(cfg: DictConfig, aux_layer_ids, data) -> dict:
    """What offline features depend on: checked when training reads them."""
    return {"target": str(cfg.target.path), "aux_layer_ids": list(aux_layer_ids or []), "data": data.fingerprint}


def with_offline_features(cfg: DictConfig, target, data):
    from specdistill.data.features import FeatureStore, WithFeatures

    store = FeatureStore(cfg.data.offline_dir)
    want = feature_meta(cfg, target.aux_layer_ids, data)
    if not target.aux_layer_ids:  # KD needs only the final hidden state: any aux ids will do
        want.pop("aux_layer_ids")
    store.check_matches(want)
    return WithFeatures(data.train, store)


def build(cfg: DictConfig, accelerator=None) -> Components:
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from specdistill.data.dataset import build_data
    from specdistill.models.draft import build_draft, check_tokenizers_match
    from specdistill.objectives import Models

    from specdistill.validation import validate_config

    validate_config(cfg, log=(accelerator.print if accelerator is not None else print))  # before loading anything
    if cfg.draft.path and cfg.draft.init in ("pretrained", "eagle3"):  # a warm start from a corrupt draft is refused
        from specdistill.train.integrity import check_draft_folder

        check_draft_folder(cfg.draft.path, what="draft.path draft")
    objective = validate_objective(cfg)  # fail on a bad objective before loading anything
    accelerator = accelerator or make_accelerator(cfg)
    torch.manual_seed(cfg.trainer.seed)
    log = accelerator.print
    regen = cfg.data.regenerate.enabled
    if regen and cfg.data.offline_dir:
        raise ValueError("data.regenerate.enabled=true writes its own features while decoding: set "
                         "data.offline_dir=null (or turn regeneration off to train from a dump_features.py folder)")
    with accelerator.main_process_first():  # rank 0 converts/caches the embedded target and the data first
        target = build_target(cfg)
        tokenizer = build_tokenizer(cfg)
        if regen:  # the target answers real prompts; its features are kept from the same forwards
            from specdistill.pipeline.regenerate import build_regenerated_data

            target.to(accelerator.device)
            if cfg.draft.init == "eagle3" and not target.aux_layer_ids:
                from specdistill.models.eagle3 import default_aux_layer_ids

                target.set_aux_layer_ids(default_aux_layer_ids(target.config.num_hidden_layers))
            data = build_regenerated_data(cfg, target, tokenizer, log=log)
        else:
            data = build_data(OmegaConf.to_object(cfg.data) if isinstance(cfg.data, DictConfig) else cfg.data,
                              tokenizer, log=log)
    draft_cfg = OmegaConf.to_object(cfg.draft) if isinstance(cfg.draft, DictConfig) else cfg.draft
    if draft_cfg.init == "eagle3":
        draft = build_eagle3_draft(draft_cfg, target, data)
    else:
        draft = build_draft(draft_cfg, target.model, data)
    if draft_cfg.init == "pretrained":
        check_tokenizers_match(draft_cfg.path, tokenizer)
    if cfg.data.offline_dir:
        data.train = with_offline_features(cfg, target, data)
    target.to(accelerator.device)

    t = cfg.trainer
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=t.lr,
                                  betas=tuple(t.betas), weight_decay=t.weight_decay)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, t.warmup_steps, max(t.max_steps, 1),
                                                            min_lr_rate=t.min_lr_ratio)
    draft, optimizer = accelerator.prepare(draft, optimizer)
    # Not prepared: accelerate's scheduler wrapper steps num_processes times per step; we step once per update.
    accelerator.register_for_checkpointing(scheduler)
    return Components(cfg, accelerator, Models(draft, target, tokenizer), objective, data, optimizer, scheduler,
                      Path(cfg.trainer.output_dir))
