"""Compare a store regenerated through a serving engine with our decoder's answers at T=0: how many prompts differ,
and whether each first difference is a near-tie of the target's logits or a real mismatch (pipeline/near_ties.py).

  # two stores of the same prompts and settings (e.g. engine=hf and engine=vllm, each with its own store_dir)
  python scripts/regen_compare.py --ref <store_dir_hf>/<key> --other <store_dir_vllm>/<key> --out cmp/
  # one store (the engine's), against our decoder re-run on its prompts
  python scripts/regen_compare.py --other <store_dir>/<key> --rerun --parts 4 --out cmp/   # or --parts 3:11

Writes <out>/regen_compare.json and regen_compare.md, both with the command; exits 1 when a real mismatch is found.
The target and its dtype default to those the store's settings.json names.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def part_range(text: str) -> list[int]:
    """'N' -> parts 0..N-1; 'A:B' -> parts A..B-1."""
    lo, _, hi = text.rpartition(":")
    try:
        first, end = int(lo or 0), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--parts {text!r}: pass N or A:B (integers)") from None
    if not 0 <= first < end:
        raise argparse.ArgumentTypeError(f"--parts {text!r}: an empty range (need 0 <= A < B)")
    return list(range(first, end))


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", required=True, help="the store to check (an engine's), a folder holding settings.json")
    ap.add_argument("--ref", default=None, help="the reference store (our decoder's); or pass --rerun")
    ap.add_argument("--rerun", action="store_true", help="decode --other's prompts with our decoder as the reference")
    ap.add_argument("--parts", type=part_range, default=None,
                    help="N: parts 0..N-1; A:B: parts A..B-1 (default: every part --other holds)")
    ap.add_argument("--target", default=None, help="default: the target in --other's settings.json")
    ap.add_argument("--dtype", default=None, help="default: the target dtype in --other's settings.json")
    ap.add_argument("--abs-margin", type=float, default=1e-3, help="logits this close to the best one are tied")
    ap.add_argument("--rel-margin", type=float, default=1e-3, help="... or this close relative to the best one")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="--rerun: prompts decoded together (default: the store's, so each part is one batch as in "
                         "engine=hf)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if (a.ref is None) == (not a.rerun):
        ap.error("pass either --ref <store> or --rerun (our decoder on --other's prompts), not both")
    return a


def reference_by_decoding(model, tokenizer, prompts, settings: dict, batch_size: int) -> list[list[int]]:
    """Our decoder's greedy answers to `prompts` with the store's max_new_tokens and the tokenizer's stop tokens."""
    from tqdm import tqdm

    from specdistill.pipeline.engines import HFEngine, Sampling
    from specdistill.tokens import pad_id

    eos = tokenizer.eos_token_id
    stops = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    engine, out = HFEngine(model, pad_id(tokenizer)), []
    sampling = Sampling(settings["settings"]["max_new_tokens"], 0.0, 0, stops)
    starts = range(0, len(prompts), batch_size)
    for s in tqdm(starts, desc="our decoder", unit="batch", total=len(starts)):
        out.extend(engine.answers(prompts[s: s + batch_size], sampling))
    return out


def main(argv=None) -> int:
    a = parse(argv)
    command = "python scripts/regen_compare.py " + " ".join(shlex.quote(x) for x in
                                                              (sys.argv[1:] if argv is None else argv))
    from specdistill.data.regenerated import input_differences
    from specdistill.models.target import load_causal_lm, load_tokenizer
    from specdistill.pipeline.near_ties import TieMargin, compare_answers, report_md, store_answers

    other = store_answers(Path(a.other), a.parts)
    if other.settings["settings"]["temperature"] != 0:
        raise SystemExit(f"{a.other} holds sampled answers (temperature {other.settings['settings']['temperature']}):"
                         " only greedy (T=0) answers are comparable token for token")
    target = a.target or other.settings["target"]
    model = load_causal_lm(target, a.dtype or other.settings["target_dtype"]).eval()
    if a.rerun:
        ref_name = "our decoder"
        batch = a.batch_size or other.settings["settings"]["batch_size"]
        ref = reference_by_decoding(model, load_tokenizer(target), other.prompts, other.settings, batch)
    else:
        ref_name = "reference"
        stored = store_answers(Path(a.ref), other.parts)
        diff = [d for d in input_differences(stored.settings, other.settings) if not d.startswith(("layers", "target"))]
        if diff or stored.prompts != other.prompts:
            raise SystemExit(f"{a.ref} and {a.other} answer other prompts or with other settings ({'; '.join(diff)}): "
                             "compare stores made with the same data.regenerate settings and target")
        ref = stored.answers
    cmp = compare_answers(model, other.prompts, ref, other.answers, TieMargin(a.abs_margin, a.rel_margin))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "regen_compare.json").write_text(json.dumps(
        {"command": command, "reference": "our decoder, re-run" if a.rerun else str(a.ref), "other": str(a.other),
         "target": str(target), **cmp.to_dict()}, indent=1))
    (out / "regen_compare.md").write_text(report_md(cmp, "Regenerated answers: engine against our decoder", command,
                                                    ref_name, "engine"))
    s = cmp.summary()
    print(f"[regen_compare] {s['prompts']} prompts: {s['identical']} identical, {s['near_ties']} near-ties, "
          f"{s['real_mismatches']} real mismatches -> {out}/regen_compare.json, regen_compare.md")
    return 1 if cmp.real else 0


if __name__ == "__main__":
    sys.exit(main())
