"""Regeneration speed of each answer engine: the same prompts regenerated with data.regenerate.engine=hf (our decoder,
features captured while decoding) and engine=vllm (vLLM writes the answers, one prefill per part their features), one
after the other into stores of their own, then their answers compared at T=0 (pipeline/near_ties.py).

  # the main command's first 80 prompts (5 parts of 16), from the interpreter that imports vllm
  .venv-vllm/bin/python -m benchmarks.regenerate_engines --prompts 80 --out outputs/regenerate_engines
  # shard 0/10 of the main command's 800 prompts (parts 0, 10, 20, ...)
  .venv-vllm/bin/python -m benchmarks.regenerate_engines --prompts 800 --shard 0/10 --out outputs/regenerate_engines
  # a seconds-long check of the script itself: 4 prompts x 8 tokens, vllm only where it imports
  python -m benchmarks.regenerate_engines --tiny --out /tmp/bench_regenerate_tiny

Reports per engine: answer tokens/s (answer stage), recapture tokens/s (features by prefill, prompt + answer tokens),
answer tokens per second of both stages together, and the wall time (which adds the engine's start and the store's
digests); writes <out>/regenerate_engines.json and regenerate_engines.md with the command. Settings are the recipe's
(--recipe, eagle3_serve by default, plus --override), so the numbers are those of the main command's regeneration.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

TINY = dict(prompts=4, max_new_tokens=8, batch_size=2)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=80, help="the first N prompts of the recipe's source")
    ap.add_argument("--shard", default=None, help="i/n: only the parts p %% n == i of those prompts")
    ap.add_argument("--engines", nargs="+", default=None, choices=["hf", "vllm"],
                    help="default: hf and vllm (with --tiny: vllm only where it imports)")
    ap.add_argument("--recipe", default="eagle3_serve")
    ap.add_argument("--override", nargs="*", default=[], help="Hydra overrides, e.g. data.regenerate.max_new_tokens=64")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: physical cores)")
    ap.add_argument("--tiny", action="store_true",
                    help=f"{TINY['prompts']} prompts x {TINY['max_new_tokens']} tokens, parts of {TINY['batch_size']}")
    ap.add_argument("--keep-stores", action="store_true", help="keep the stores in <out>/stores (default: deleted)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    vllm_here = importlib.util.find_spec("vllm") is not None
    if a.engines is None:
        a.engines = ["hf", "vllm"] if vllm_here or not a.tiny else ["hf"]
    if "vllm" in a.engines and not vllm_here:
        ap.error(f"--engines vllm: this interpreter ({sys.executable}) does not import vllm; run it from the venv "
                 "`bash scripts/setup.sh --vllm` makes (.venv-vllm/bin/python), or pass --engines hf")
    if a.tiny:
        a.prompts = TINY["prompts"]
    return a


def regenerate_config(a):
    """The recipe's data.regenerate with this benchmark's prompt count and shard, and the composed run config."""
    from omegaconf import OmegaConf

    from benchmarks.recipes import compose
    from specdistill.config import RegenerateConfig

    cfg = compose(a.recipe, list(a.override))
    rcfg = RegenerateConfig(**OmegaConf.to_container(cfg.data.regenerate, resolve=True))
    rcfg = replace(rcfg, enabled=True, max_prompts=a.prompts, shard=a.shard)
    if a.tiny:
        rcfg = replace(rcfg, max_new_tokens=TINY["max_new_tokens"], batch_size=TINY["batch_size"])
    return cfg, rcfg


def run_engine(engine: str, rcfg, model, tok, target_path: str, aux: list[int], store_dir: Path) -> dict:
    """One engine's regeneration into a store of its own; its timing from the store's part records."""
    from specdistill.pipeline.regenerate import regenerate_store
    from specdistill.pipeline.telemetry import read_parts, stage_timing

    t0 = time.perf_counter()
    root, parts = regenerate_store(replace(rcfg, engine=engine, store_dir=str(store_dir)), model, tok, target_path,
                                   aux)
    wall = time.perf_counter() - t0
    stages = stage_timing(read_parts(root, parts))
    if len(stages) != 1:
        raise RuntimeError(f"{root} was written by {sorted(stages)}, not by engine={engine} alone")
    st = next(iter(stages.values()))
    return {"engine": engine, "store": str(root), "parts": st["parts"], "rows": st["rows"],
            "prompt_tokens": st["prompt_tokens"], "answer_tokens": st["answer_tokens"], "answer_s": st["answer_s"],
            "recapture_s": st["recapture_s"], "answer_tok_s": st["answer_tok_s"],
            "recapture_tok_s": st["recapture_tok_s"], "total_s": st["total_s"],
            "total_answer_tok_s": st["answer_tok_s_overall"], "wall_s": round(wall, 1),
            "other_s": round(wall - st["total_s"], 1)}


def compare(model, results: list[dict]) -> dict | None:
    """hf's answers against vllm's at T=0: identical prompts, near-ties, real mismatches."""
    from specdistill.pipeline.near_ties import compare_answers, store_answers

    roots = {r["engine"]: Path(r["store"]) for r in results}
    if set(roots) != {"hf", "vllm"}:
        return None
    theirs = store_answers(roots["vllm"])  # with --shard: the shard's parts
    ours = store_answers(roots["hf"], theirs.parts)
    if ours.settings["settings"]["temperature"] != 0 or ours.prompts != theirs.prompts:
        return None
    return compare_answers(model, ours.prompts, ours.answers, theirs.answers).summary()


def report_md(result: dict) -> str:
    lines = ["# Regeneration speed by answer engine", "", f"Command: `{result['command']}`", "",
             f"{result['prompts']} prompts{' (shard ' + result['shard'] + ')' if result['shard'] else ''} of "
             f"`{result['source']}`, <= {result['max_new_tokens']} new tokens at T={result['temperature']}, parts of "
             f"{result['batch_size']}, target `{result['target']}` ({result['target_dtype']}), {result['threads']} "
             "threads.", "",
             "| engine | parts | answer tokens | answer tok/s | recapture tok/s | answers + features, answer tok/s "
             "| answer s | recapture s | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["engines"]:
        lines.append(f"| {r['engine']} | {r['parts']} | {r['answer_tokens']} | {r['answer_tok_s']} | "
                     f"{r['recapture_tok_s'] or '- (while decoding)'} | {r['total_answer_tok_s']} | {r['answer_s']} | "
                     f"{r['recapture_s']} | {r['wall_s']} |")
    by = {r["engine"]: r for r in result["engines"]}
    if {"hf", "vllm"} <= set(by) and all(by[e]["answer_tok_s"] and by[e]["total_answer_tok_s"] for e in by):
        hf, vl = by["hf"], by["vllm"]
        lines += ["", f"vllm against hf: answers {vl['answer_tok_s'] / hf['answer_tok_s']:.2f}x, answers + features "
                      f"{vl['total_answer_tok_s'] / hf['total_answer_tok_s']:.2f}x, wall "
                      f"{hf['wall_s'] / vl['wall_s']:.2f}x (wall adds vLLM's start)."]
    c = result.get("comparison")
    if c:
        lines += ["", f"Answers at T=0: {c['identical']} of {c['prompts']} prompts identical, {c['near_ties']} differ "
                      f"at a near-tie of the target's logits, {c['real_mismatches']} real mismatches."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    command = f"{Path(sys.executable).name} -m benchmarks.regenerate_engines " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    from specdistill.data.chat import set_chat_template
    from specdistill.drafts.eagle3.model import default_aux_layer_ids
    from specdistill.models.target import load_causal_lm, load_tokenizer
    from specdistill.pipeline.regenerate import regeneration_batch_size
    from specdistill.threads import configure_threads

    threads = configure_threads(a.threads, "--threads").threads
    cfg, rcfg = regenerate_config(a)
    target_path = str(cfg.target.path)
    model = load_causal_lm(target_path, cfg.target.dtype).eval()
    tok = load_tokenizer(target_path)
    set_chat_template(tok, cfg.data.get("chat_template"))
    aux = list(cfg.target.aux_layer_ids or default_aux_layer_ids(model.config.num_hidden_layers))
    rcfg = replace(rcfg, batch_size=regeneration_batch_size(rcfg, model))  # as the pipeline resolves null
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stores = out / "stores" if a.keep_stores else Path(tempfile.mkdtemp(prefix="regenerate_engines."))
    try:
        results = [run_engine(e, rcfg, model, tok, target_path, aux, stores / e) for e in a.engines]
        comparison = compare(model, results)
    finally:
        if not a.keep_stores:
            shutil.rmtree(stores, ignore_errors=True)
    result = {"command": command, "prompts": a.prompts, "shard": a.shard, "source": rcfg.prompts,
              "max_new_tokens": rcfg.max_new_tokens, "temperature": rcfg.temperature,
              "batch_size": rcfg.batch_size, "target": target_path,
              "target_dtype": cfg.target.dtype, "threads": threads, "engines": results, "comparison": comparison}
    (out / "regenerate_engines.json").write_text(json.dumps(result, indent=1))
    (out / "regenerate_engines.md").write_text(report_md(result))
    print(report_md(result))
    print(f"wrote {out}/regenerate_engines.json, regenerate_engines.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
