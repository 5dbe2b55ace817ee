"""Real speculative evaluation inside training: the loop calls spec_eval_hook at each epoch end.

Same code as scripts/evaluate.py (specdistill.eval.evaluator over specdistill.decoding), on a small prompt set
(eval.prompts, eval.num_prompts, eval.max_new_tokens), without the batch sweep or the HF comparison. Every process of
a launch decodes a share of the prompt batches with its own replica (eval/merge.shares); rank 0 merges the counts
into the result one process would give (eval/merge.merge_results), writes the report and returns the metrics, the
other ranks return {}. Drafts sharded across ranks (FSDP, DeepSpeed ZeRO-3) have no full copy on any rank, so the hook
skips them (with a message) rather than hang.
"""
from __future__ import annotations

from dataclasses import replace

from specdistill.tensors import unwrap_target

_warned: set[str] = set()


def _sharded(acc) -> bool:
    from specdistill.train.distributed import is_sharded  # FSDP, ZeRO-3, and FSDP2 on CPU (fully_shard over gloo)

    return is_sharded(acc)


def spec_eval_hook(c, epoch: int, step: int) -> dict:
    """Speculative eval of the current draft against the target; returns spec/* metrics (rank 0) and writes
    c.output_dir/eval/epoch-{epoch}/results.json. Returns {} at once when eval.spec_eval is false."""
    ecfg = c.eval
    if not ecfg.spec_eval or ecfg.spec_eval_at == "end":
        return {}
    return run_spec_eval(c, epoch, step)


def final_spec_eval(c, epoch: int, step: int) -> dict:
    """eval.spec_eval_at=end: the one speculative evaluation after the last step (pipeline/run.py calls it)."""
    if not c.eval.spec_eval or c.eval.spec_eval_at != "end":
        return {}
    return run_spec_eval(c, epoch, step, name="final")


def run_spec_eval(c, epoch: int, step: int, name: str | None = None) -> dict:
    acc = c.accelerator
    if _sharded(acc):
        if "sharded" not in _warned:
            acc.print("[spec-eval] skipped: the draft is sharded across ranks (FSDP / ZeRO-3); run "
                      "scripts/evaluate.py eval.draft_path=<checkpoint>/draft instead")
            _warned.add("sharded")
        return {}
    name = name or f"epoch-{epoch}"
    # A target sharded over the processes (target.shard=fsdp) runs collective forwards: then every process decodes
    # every prompt in step, and rank 0 reports its own result.
    sharing = 1 if c.target_shard == "fsdp" else acc.num_processes
    mine = _evaluate_share(c, step, name, sharing)  # (result or None, the prompts' indices in the whole set)
    every = [mine]
    if sharing > 1:
        from accelerate.utils import gather_object

        every = gather_object([mine])
    metrics: dict = {}
    if acc.is_main_process:
        from specdistill.eval.merge import merge_results

        result = mine[0] if len(every) == 1 else merge_results([r for r, _ in every], [ix for _, ix in every])
        metrics = _report(c, result, epoch, step, name)
    acc.wait_for_everyone()
    return metrics


def _evaluate_share(c, step: int, name: str, sharing: int):
    """This process's share of the evaluation among `sharing` processes: (EvalResult of its prompt batches or None
    when it has none, their indices in the whole prompt set)."""
    from specdistill.decoding.kv import max_positions
    from specdistill.drafts.base import decoding_precision
    from specdistill.data.prompts import load_prompts
    from specdistill.eval.evaluator import evaluate, for_training
    from specdistill.eval.merge import shares

    acc = c.accelerator
    cfg = for_training(c.eval)
    target = unwrap_target(c.models.target)
    tokenizer = c.models.tokenizer
    draft = acc.unwrap_model(c.models.draft)
    prompts = load_prompts(cfg.prompts, tokenizer, num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens,
                           context=max_positions(target), max_prompt_tokens=cfg.max_prompt_tokens,
                           split=cfg.prompts_split, heldout=getattr(c.data, "heldout_messages", None))
    index = shares(len(prompts), cfg.batch_size, sharing)[acc.process_index if sharing > 1 else 0]
    if not index:
        return None, index
    spec = draft if cfg.drafter == "draft" else cfg.drafter
    split = f", {sharing} processes sharing them" if sharing > 1 else ""
    acc.print(f"[spec-eval] {name} step {step}: speculative decoding of {len(prompts)} prompts x up to "
              f"{cfg.max_new_tokens} tokens, then the target alone (eval.num_prompts, eval.max_new_tokens){split}")
    was_training = draft.training
    draft.eval()
    try:
        # its own progress bar (with an ETA) on rank 0: the training bar sits at 100% meanwhile; the draft at the
        # target's precision (autocast beside a bf16 target, its fp32 weights kept), verification in fp32
        with decoding_precision(target):
            result = evaluate(target, tokenizer, spec, replace(prompts, prompts=[prompts.prompts[i] for i in index]),
                              cfg, progress=acc.is_main_process, log=acc.print)
    finally:
        draft.train(was_training)
    return result, index


def _report(c, result, epoch: int, step: int, name: str) -> dict:
    """Write the evaluation's report under the run's eval/ folder and return its spec/* metrics."""
    from specdistill.eval.report import write_report

    write_report(result, c.output_dir / "eval" / name, plots=name == "final", extra={"epoch": epoch, "step": step})
    metrics = result.flat("spec/")
    metrics["spec/epoch"] = float(epoch)
    mm = "-" if result.greedy_mismatches is None else result.greedy_mismatches
    c.accelerator.print(f"[spec-eval] {name} step {step}: tau {result.mean_accept_len:.3f}, speedup "
                        f"{result.speedup:.3f}x ({result.tokens_per_s:.1f} vs {result.target_only_tokens_per_s:.1f} "
                        f"tok/s), a_k {[round(a, 3) for a in result.accept_rate_per_pos]}, greedy mismatches {mm}")
    return metrics
