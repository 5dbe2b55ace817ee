"""HF transformers' own generate as a baseline at batch 1: plain, assisted by the draft, or prompt lookup (n-gram)."""
from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch

from specdistill.config import EvalConfig
from specdistill.decoding import Drafter, LMDrafter, NGramDrafter
from specdistill.decoding.kv import device_of
from specdistill.eval.batches import PromptBatch
from specdistill.eval.timing import Run, Runner, timed

HF_MODES = ("assisted_gamma", "assisted_default", "target_only")


@contextmanager
def _assistant_settings(assistant, mode: str, gamma: int):
    """assisted_gamma: HF drafts exactly gamma tokens per round (ours, fixed gamma); assisted_default: HF's defaults
    (20 tokens, stop drafting below 0.4 confidence). HF reads these from the assistant's generation_config."""
    gc = assistant.generation_config
    saved = {k: getattr(gc, k, None) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                              "assistant_confidence_threshold")}
    if mode == "assisted_gamma":
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = gamma, "constant"
        gc.assistant_confidence_threshold = 0.0
    else:
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = None, None, None
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(gc, k, v)


@torch.no_grad()
def hf_generate(target_model, batch: PromptBatch, *, max_new_tokens: int, eos: Optional[list[int]], pad_id: int,
                mode: str = "target_only", assistant=None, prompt_lookup: Optional[int] = None,
                ngram_max: int = 3, gamma: int = 4) -> list[list[int]]:
    """HF transformers' greedy generate (batch 1): plain, assisted by `assistant`, or prompt lookup (n-gram)."""
    if batch.input_ids.shape[0] != 1:
        raise ValueError("HF assisted generation runs at batch size 1 only")
    gc = copy.deepcopy(target_model.generation_config)
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens = False, max_new_tokens, None
    gc.temperature = gc.top_p = gc.top_k = None
    gc.eos_token_id, gc.pad_token_id = eos, pad_id
    kwargs: dict = {}
    if mode != "target_only":
        if prompt_lookup:
            gc.prompt_lookup_num_tokens, gc.max_matching_ngram_size = prompt_lookup, ngram_max
        else:
            kwargs["assistant_model"] = assistant
    ctx = _assistant_settings(assistant, mode, gamma) if kwargs.get("assistant_model") is not None else nullcontext()
    with ctx:
        out = target_model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                    generation_config=gc, **kwargs)
    new = out[0, batch.input_ids.shape[1]:].tolist()
    if eos is None:
        return new
    cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return new[:cut]



def hf_runners(target_model, drafter: Drafter, drafter_name: str, cfg: EvalConfig, eos: Optional[list[int]],
               pad_id: int, max_new_tokens: int) -> dict[str, Runner]:
    """One timed runner per HF mode, named hf_<mode>: the draft model assists HF, or the n-gram drafter becomes HF's
    prompt lookup (then only assisted_gamma and target_only)."""
    assistant = drafter.model if isinstance(drafter, LMDrafter) else None
    lookup = cfg.gamma if isinstance(drafter, NGramDrafter) else None
    if assistant is None and lookup is None:
        raise ValueError(f"eval.compare_hf needs a draft model or the n-gram drafter, not {drafter_name}")
    modes = ("assisted_gamma", "target_only") if lookup else HF_MODES
    device = device_of(target_model)

    def runner(mode: str):
        def run(b: PromptBatch) -> Run:
            toks, t = timed(device, lambda: hf_generate(
                target_model, b, max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id, mode=mode,
                assistant=assistant, prompt_lookup=lookup, ngram_max=cfg.ngram_max, gamma=cfg.gamma))
            return Run([toks], t)
        return run
    return {f"hf_{m}": runner(m) for m in modes}


def hf_summary(ours: list[Run], ours_target: list[Run], hf_runs: dict[str, list[Run]], drafter: str) -> dict:
    """Ours vs HF at batch 1: identical outputs (per prompt) and time ratios (ours / HF: < 1 means ours is faster)."""
    def total(runs):
        return sum(r.seconds for r in runs), sum(len(t) for r in runs for t in r.tokens)

    ours_s, ours_tok = total(ours)
    ours_t_s, ours_t_tok = total(ours_target)
    out: dict[str, Any] = {"drafter": drafter, "num_prompts": len(ours), "ours_seconds": ours_s,
                           "ours_tokens_per_s": ours_tok / ours_s, "ours_target_only_seconds": ours_t_s,
                           "ours_target_only_tokens_per_s": ours_t_tok / ours_t_s}
    for name, runs in hf_runs.items():
        s, tok = total(runs)
        ref = ours_target if name == "hf_target_only" else ours
        same = sum(a.tokens == b.tokens for a, b in zip(runs, ref))
        mine = ours_t_s if name == "hf_target_only" else ours_s
        out[name] = {"seconds": s, "tokens_per_s": tok / s, "identical_outputs": same,
                     "identical_to_target_only": sum(a.tokens == b.tokens for a, b in zip(runs, ours_target)),
                     "time_ratio_ours_over_hf": mine / s,
                     "hf_speedup_vs_our_target_only": (tok / s) / (ours_t_tok / ours_t_s)}
    return out
