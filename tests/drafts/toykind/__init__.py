"""A toy draft kind, written here and nowhere else: importing this module registers it, and then `draft.init=toy`
trains, evaluates and exports through the ordinary entry points (tests/drafts/test_kind_registry.py).

The draft is a one-layer causal LM of the target's (Llama) architecture at its own width (draft.hidden_size, the one
size it honours), saved under its own architecture name. It drafts and trains as an LM draft does (its adapter takes
LMDraft's decoding and losses) and exports to one format of its own, "toy": its weights and a config.json naming
ToyDraftExport, checked tensor by tensor when written and when read back. It proposes at most MAX_DRAFT tokens a
round (validation refuses a longer eval.gamma), and its folders are refused as a target by its name (the registry's
default: the folders its saved_in and export architectures claim).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.drafts import LMDraft
from specdistill.drafts.readback import unfit
from specdistill.drafts.registry import Card, DraftLength, register_kind
from specdistill.export import WEIGHTS_FILE, ExportResult, read_target_config, write_weights
from specdistill.files import replace_folder

EXPORT_ARCH = "ToyDraftExport"
MAX_DRAFT = 6  # tokens one toy proposal holds at most


class ToyDraftForCausalLM(LlamaForCausalLM):
    """A Llama LM saved as its own architecture (config.json: architectures ["ToyDraftForCausalLM"])."""


def build_toy(draft_cfg, target_model) -> ToyDraftForCausalLM:
    """draft.num_layers layers of the target's architecture at width draft.hidden_size (null: the target's)."""
    if not isinstance(target_model.config, LlamaConfig):
        raise ValueError(f"draft.init=toy needs a Llama target, got {type(target_model.config).__name__}")
    c = copy.deepcopy(target_model.config)
    c.num_hidden_layers = draft_cfg.num_layers
    if draft_cfg.hidden_size is not None:
        c.hidden_size, c.intermediate_size = draft_cfg.hidden_size, 2 * draft_cfg.hidden_size
        c.head_dim = draft_cfg.hidden_size // c.num_attention_heads
    return ToyDraftForCausalLM(c).train()


def fits_target(draft, path, target_model, target_name: str, log) -> None:
    """Beyond the vocabulary: the toy drafts only beside a target of its own architecture family."""
    if target_model.config.model_type != draft.config.model_type:
        raise unfit(path, target_name, f"a toy draft of model_type {draft.config.model_type} drafts only for a target "
                                       f"of that type, not {target_model.config.model_type}")


def check_toy_export(path, target_path: Optional[str] = None) -> ExportResult:
    """Re-read a toy export: its config names ToyDraftExport, lm_head is (vocab_size, hidden_size), every tensor is
    finite, and the vocabulary is --target's when given. Raises ValueError listing every problem."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    sd = load_file(str(path / WEIGHTS_FILE))
    errs = [] if config.get("architectures") == [EXPORT_ARCH] else [f"architectures is not [{EXPORT_ARCH!r}]"]
    want = (config.get("vocab_size"), config.get("hidden_size"))
    if "lm_head.weight" not in sd or tuple(sd["lm_head.weight"].shape) != want:
        errs.append(f"lm_head.weight must be {list(want)}")
    errs += [f"tensor {k} has non-finite values" for k, v in sd.items() if not bool(torch.isfinite(v.float()).all())]
    if target_path is not None and read_target_config(target_path)[1].get("vocab_size") != config.get("vocab_size"):
        errs.append(f"the target {target_path} has another vocabulary")
    if errs:
        raise ValueError(f"{path} is not a valid toy export:\n  - " + "\n  - ".join(errs))
    tensors = {k: (list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in sd.items()}
    return ExportResult(path, "toy", tensors, [], config)


def export_toy(draft_dir, out_dir, fmt: str = "toy", target_path: Optional[str] = None, overwrite: bool = False,
               **_other_kinds_options) -> ExportResult:
    """The checkpoint's draft folder as a toy export in out_dir, re-read and checked before it takes the name."""
    from safetensors.torch import load_file

    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists: pass overwrite=True (--overwrite) or another folder")
    config = json.loads((draft_dir / "config.json").read_text()) | {"architectures": [EXPORT_ARCH]}
    with replace_folder(out_dir, overwrite) as tmp:
        write_weights(tmp, load_file(str(draft_dir / WEIGHTS_FILE)), config)
        check_toy_export(tmp, target_path)
    return check_toy_export(out_dir)


def toy_length(draft_cfg, saved: Optional[Path]) -> DraftLength:
    """Every toy draft, built or saved, proposes at most MAX_DRAFT tokens a round."""
    return DraftLength(MAX_DRAFT, f"what a toy draft proposes ({MAX_DRAFT} tokens a round)",
                       lambda asked: "draft.init=pretrained (an LM draft proposes any number)")


@register_kind(name="toy", inits={"toy": ("hidden_size",)}, card=Card("A toy draft", tags=("toy",)),
               exporters={"toy": export_toy}, validator=check_toy_export, export_architectures=(EXPORT_ARCH,),
               fits=fits_target, max_draft_length=toy_length)
class ToyDraft(LMDraft):
    """The toy's adapter: LMDraft's drafting and losses on a ToyDraftForCausalLM."""

    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        return isinstance(model, ToyDraftForCausalLM)

    @classmethod
    def build(cls, draft_cfg, target, data) -> torch.nn.Module:
        return build_toy(draft_cfg, target.model)

    @classmethod
    def saved_in(cls, path) -> bool:
        cfg_file = Path(path) / "config.json"
        return cfg_file.exists() and "ToyDraftForCausalLM" in json.loads(cfg_file.read_text()).get("architectures", [])

    @classmethod
    def load(cls, path) -> torch.nn.Module:
        return ToyDraftForCausalLM.from_pretrained(path)

    @classmethod
    def warm_start_overrides(cls, path) -> list[str]:
        raise ValueError("a toy draft has no warm start")
