"""scripts/evaluate.py's body: config -> target, tokenizer, drafter, prompts -> evaluate -> report files."""
from __future__ import annotations

from pathlib import Path

import dataclasses

import torch
from omegaconf import DictConfig

from specdistill.config import Config, EvalConfig

from specdistill.eval.evaluator import EvalResult, check_eval_config, evaluate
from specdistill.data.prompts import load_prompts
from specdistill.eval.report import write_report
from specdistill.files import check_writable, folder_lock, named_writes

RESULT_FILES = ("results.json", "results.md", "outputs.jsonl")  # what an evaluation writes (eval/report.py)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_draft(cfg: Config, target_model, tokenizer, log=print):
    """eval.draft_path (a trained HF draft folder) if set, else a draft built from the `draft` group (untrained)."""
    from specdistill.drafts import check_readable, kind_for_init, load_trained_draft
    from specdistill.drafts.base import cast_for_decoding
    from specdistill.drafts.readback import check_draft_tokenizer, read_back
    from specdistill.models.target import Target

    path = cfg.eval.draft_path
    if path:
        if not (Path(path).expanduser() / "config.json").exists() and Path(path).expanduser().exists():
            raise FileNotFoundError(f"eval.draft_path={path} has no config.json: point it at a checkpoint's draft/ "
                                    "folder, e.g. outputs/kd/checkpoints/step-0000040/draft")
        from specdistill.files import check_draft_folder

        check_draft_folder(path, what="eval.draft_path draft")  # sizes, checksums, safetensors headers
        check_readable(path)  # a speculators-format export is refused by name
        draft = load_trained_draft(path)  # a standalone LM or an EAGLE-3 head
        read_back(draft, path, target_model, target_name=str(cfg.target.path), log=log)  # shapes, embeddings
        check_draft_tokenizer(path, tokenizer, log)  # or says that it is skipped
        log(f"[eval] draft from {path}")
    else:
        draft_cfg = cfg.draft
        kind = kind_for_init(draft_cfg.init)
        if kind.spec.needs_data_to_build:
            raise ValueError(f"an {kind.kind} draft needs training data for its vocabulary: pass eval.draft_path=<a "
                             "trained draft's checkpoint draft/ folder>")
        draft = kind.build(draft_cfg, Target(target_model), None)
        log(f"[eval] no eval.draft_path: an UNTRAINED draft built from the draft group (init={draft_cfg.init}, "
            f"num_layers={draft_cfg.num_layers}); pass eval.draft_path=.../checkpoints/step-N/draft for a trained one")
    return cast_for_decoding(draft, target_model).requires_grad_(False).eval()  # the target's dtype


def run(composed: DictConfig, log=print) -> tuple[EvalResult, dict[str, Path]]:
    """Evaluate Hydra's composed config into eval.output_dir: refused when another evaluation writes there, or when
    it holds results already (unless eval.overwrite=true)."""
    from specdistill.entry import load_config

    cfg = load_config(composed, log=log)  # checked and typed once: before loading anything
    ecfg = cfg.eval
    check_eval_config(ecfg)  # fail before loading anything
    out = Path(ecfg.output_dir).expanduser()
    check_writable(out, "eval.output_dir")
    with folder_lock(out, "eval.output_dir", log=log):  # one evaluation writes into a folder at a time
        check_no_results(out, ecfg)
        return _evaluate(cfg, ecfg, out, log)


def check_no_results(out: Path, cfg: EvalConfig) -> None:
    """Refuse a folder that already holds an evaluation's results unless eval.overwrite=true, suggesting a folder
    named after the draft and the settings."""
    if cfg.overwrite:
        return
    found = [f for f in RESULT_FILES if (out / f).exists()]
    if found:
        raise FileExistsError(f"eval.output_dir={out} already holds {', '.join(found)} of an earlier evaluation: "
                              f"write this one elsewhere, e.g. eval.output_dir={out.parent / default_folder(cfg)}, or "
                              "pass eval.overwrite=true to replace them")


def default_folder(e: EvalConfig) -> str:
    """A folder name that says which draft was evaluated and how: eval_<draft>_<prompts>_g<gamma>_t<temperature>."""
    if e.drafter == "draft" and e.draft_path:
        p = Path(e.draft_path).expanduser()
        parts = [q for q in (p.parent.parent.parent.name, p.parent.name, p.name) if q and q != "draft"]
        draft = "-".join(parts[-2:]) or "draft"
    else:
        draft = e.drafter
    prompts = Path(str(e.prompts).split(":")[-1]).stem  # embedded:mt_bench -> mt_bench, /data/p.jsonl -> p
    name = f"eval_{draft}_{prompts}_g{e.gamma}{'dyn' if e.dynamic_gamma else ''}_t{e.temperature:g}"
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)


def _evaluate(cfg: Config, ecfg: EvalConfig, out: Path, log) -> tuple[EvalResult, dict[str, Path]]:
    from specdistill.build import build_tokenizer
    from specdistill.models.target import load_causal_lm
    from specdistill.decoding.kv import max_positions
    from specdistill.threads import configure_threads

    device = resolve_device(ecfg.device)

    threads = configure_threads(ecfg.threads, "eval.threads", log=log)  # deliberate and printed, never torch's default
    torch.manual_seed(ecfg.seed)
    target = load_causal_lm(cfg.target.path, cfg.target.dtype).to(device).eval().requires_grad_(False)
    tokenizer = build_tokenizer(cfg)
    prompts = load_prompts(ecfg.prompts, tokenizer, num_prompts=ecfg.num_prompts, max_new_tokens=ecfg.max_new_tokens,
                           context=max_positions(target), max_prompt_tokens=ecfg.max_prompt_tokens,
                           split=ecfg.prompts_split)
    if prompts.replacement_chars:
        log(f"[eval] {prompts.replacement_chars} replacement characters (U+FFFD: bytes that were not valid UTF-8) in "
            f"the prompts of {ecfg.prompts}: they are evaluated as they are (results.json: prompt_replacement_chars)")
    if prompts.skipped_too_long:
        log(f"[eval] {prompts.skipped_too_long} prompts longer than eval.max_prompt_tokens={ecfg.max_prompt_tokens} "
            "skipped")
    spec = load_draft(cfg, target, tokenizer, log).to(device) if ecfg.drafter == "draft" else ecfg.drafter
    log(f"[eval] target {cfg.target.path} on {device}; {len(prompts)} prompts from {ecfg.prompts}; "
        f"drafter={ecfg.drafter} gamma={ecfg.gamma}{' (dynamic)' if ecfg.dynamic_gamma else ''} "
        f"T={ecfg.temperature} draft_policy={ecfg.draft_policy} max_new_tokens={ecfg.max_new_tokens} "
        f"batch={ecfg.batch_size}")
    if ecfg.block_sizes:  # before the main evaluation: a drafter without a block size is refused here
        if not isinstance(spec, torch.nn.Module):
            raise ValueError(f"eval.block_sizes={list(ecfg.block_sizes)} sweeps a block drafter's block size; "
                             f"eval.drafter={ecfg.drafter} has none: set eval.drafter=draft with a DFlash draft")
        from specdistill.drafts import draft_adapter

        draft_adapter(spec).at_block_size(ecfg.block_sizes[0])
    result = evaluate(target, tokenizer, spec, prompts, ecfg, log=log)
    extra = {"target_path": cfg.target.path, "draft_path": ecfg.draft_path,
             "prompts_skipped_too_long": prompts.skipped_too_long,
             "prompt_replacement_chars": prompts.replacement_chars, "threads": threads.to_dict(),
             "config": dataclasses.asdict(ecfg)}
    with named_writes(out, "eval.output_dir", "no result file is complete; the evaluation must run again"):
        paths = write_report(result, out, extra=extra)
    log(summary_line(result))
    log(f"[eval] wrote {', '.join(sorted(p.name for p in paths.values()))} to {ecfg.output_dir}")
    if ecfg.block_sizes:  # a block drafter at several block sizes: the measured cost model, the fastest named
        from specdistill.eval.block_sweep import block_size_sweep

        sweep = block_size_sweep(target, tokenizer, spec, prompts, ecfg, list(ecfg.block_sizes), log=log)
        with named_writes(out, "eval.output_dir", "the block size sweep must run again"):
            written = sweep.write(out)
        log(sweep.markdown())
        log(f"[eval] wrote {', '.join(sorted(p.name for p in written.values()))} to {ecfg.output_dir}")
    return result, paths


def predicted_main(r: EvalResult):
    """The cost model's predicted speedup of the setting the evaluation decoded (chain of gamma, or its tree), or
    None when the cost model did not cost that setting."""
    if not r.cost_model or r.dynamic_gamma:
        return None
    name = r.tree["name"] if r.tree else f"chain{r.gamma}"
    return next((s["predicted_speedup"] for s in r.cost_model.get("settings", []) if s["name"] == name), None)


def summary_line(r: EvalResult) -> str:
    mm = "-" if r.greedy_mismatches is None else r.greedy_mismatches
    s = (f"[eval] {r.drafter}: tau {r.mean_accept_len:.3f} | {r.tokens_per_s:.2f} tok/s vs target-only "
         f"{r.target_only_tokens_per_s:.2f} | speedup {r.speedup:.3f}x | greedy mismatches {mm}")
    main = predicted_main(r)
    if main is not None:
        s += f" | predicted {main:.3f}x (cost model: draft, verify v(k) and bookkeeping as measured)"
    elif r.predicted_speedup is not None:
        s += f" | predicted {r.predicted_speedup:.2f}x (Leviathan, from alpha and c={r.cost.c:.3f}; no verify cost)"
    if r.hf:
        for k, v in r.hf.items():
            if isinstance(v, dict):
                s += f" | {k}: {v['tokens_per_s']:.2f} tok/s, ours/HF time {v['time_ratio_ours_over_hf']:.3f}"
    return s
