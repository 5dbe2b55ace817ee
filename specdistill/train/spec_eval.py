"""Real speculative evaluation inside training: the loop calls spec_eval_hook at each epoch end.

Same code as scripts/evaluate.py (specdistill.eval.evaluator over specdistill.decoding), on a small prompt set
(eval.prompts, eval.num_prompts, eval.max_new_tokens), without the batch sweep or the HF comparison. Rank 0 runs it;
the other ranks wait at a barrier and return {}. Drafts sharded across ranks (FSDP, DeepSpeed ZeRO-3) have no full
copy on rank 0, so the hook skips them (with a message) rather than hang.
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from specdistill.tensors import unwrap_target

_warned: set[str] = set()


def _sharded(acc) -> bool:
    from specdistill.train.distributed import is_sharded  # FSDP, ZeRO-3, and FSDP2 on CPU (fully_shard over gloo)

    return is_sharded(acc)


def spec_eval_hook(c, epoch: int, step: int) -> dict:
    """Speculative eval of the current draft against the target; returns spec/* metrics (rank 0) and writes
    c.output_dir/eval/epoch-{epoch}/results.json. Returns {} at once when cfg.eval.spec_eval is false."""
    ecfg = c.cfg.eval
    if not ecfg.spec_eval or ecfg.spec_eval_at == "end":
        return {}
    return run_spec_eval(c, epoch, step)


def final_spec_eval(c, epoch: int, step: int) -> dict:
    """eval.spec_eval_at=end: the one speculative evaluation after the last step (pipeline/run.py calls it)."""
    if not c.cfg.eval.spec_eval or c.cfg.eval.spec_eval_at != "end":
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
    metrics: dict = {}
    if acc.is_main_process:
        metrics = _evaluate_on_this_rank(c, epoch, step, name or f"epoch-{epoch}")
    acc.wait_for_everyone()
    return metrics


def _evaluate_on_this_rank(c, epoch: int, step: int, name: str) -> dict:
    from specdistill.eval.evaluator import evaluate, for_training
    from specdistill.data.prompts import load_prompts
    from specdistill.eval.report import write_report
    from specdistill.decoding.kv import max_positions

    acc = c.accelerator
    ecfg = OmegaConf.to_object(c.cfg.eval) if isinstance(c.cfg.eval, DictConfig) else c.cfg.eval
    cfg = for_training(ecfg)
    target = unwrap_target(c.models.target)
    tokenizer = c.models.tokenizer
    draft = acc.unwrap_model(c.models.draft)
    was_training = draft.training
    draft.eval()
    try:
        prompts = load_prompts(cfg.prompts, tokenizer, num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens,
                               context=max_positions(target), max_prompt_tokens=cfg.max_prompt_tokens,
                               split=cfg.prompts_split, heldout=getattr(c.data, "heldout_messages", None))
        spec = draft if cfg.drafter == "draft" else cfg.drafter
        acc.print(f"[spec-eval] {name} step {step}: speculative decoding of {len(prompts)} prompts x up to "
                  f"{cfg.max_new_tokens} tokens, then the target alone (eval.num_prompts, eval.max_new_tokens)")
        # its own progress bar (with an ETA): the training bar sits at 100% meanwhile
        result = evaluate(target, tokenizer, spec, prompts, cfg, progress=True, log=acc.print)
    finally:
        draft.train(was_training)
    final = name == "final"
    write_report(result, c.output_dir / "eval" / name, plots=final, extra={"epoch": epoch, "step": step})
    metrics = result.flat("spec/")
    metrics["spec/epoch"] = float(epoch)
    mm = "-" if result.greedy_mismatches is None else result.greedy_mismatches
    acc.print(f"[spec-eval] {name} step {step}: tau {result.mean_accept_len:.3f}, speedup {result.speedup:.3f}x "
              f"({result.tokens_per_s:.1f} vs {result.target_only_tokens_per_s:.1f} tok/s), "
              f"a_k {[round(a, 3) for a in result.accept_rate_per_pos]}, greedy mismatches {mm}")
    return metrics
