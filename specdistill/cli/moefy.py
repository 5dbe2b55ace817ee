"""`specdistill-moefy`: turn a dense target into an MoE whose experts specialise (specdistill/moe/convert.py), save it
as a standard transformers Mixtral folder, and report how real it is (specdistill/moe/realness.py).

  specdistill-moefy --experts 8 --top-k 6 --out ~/.cache/specdistill/models/smollm2-135m-moefied-e8k6
  python scripts/moefy.py --experts 8 --top-k 6 --tokens 16384            # the same, through the shim
  python scripts/profile_moe.py target=smollm2_moefied draft=moe_experts  # then the usual MoE tools

Steps: tokenize the data (ShareGPT by default, through the project's data code); run the dense model on the first
--tokens training tokens, recording every MLP's input; per layer cluster the neurons, fit the router, build the
experts; save (atomically); reload the saved folder with from_pretrained and score it against the dense model on
the held-out conversations, with code-like and chat subsets of further training conversations for routing
stability. Writes, next to the model: realness.json, realness.md and moefy.json (settings, per-layer fit
statistics, neuron groups, timings, and the key of the inputs). A second run with the same inputs (target weights,
data, settings) reuses the folder; --force rebuilds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

DEFAULT_TARGET = "embedded:smollm2-135m-instruct"
CONVERTER_VERSION = 1  # bump when the conversion changes what it writes: older caches are rebuilt


def parse_args(argv=None) -> argparse.Namespace:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--experts", type=int, default=8, help="E: experts per layer (must divide the intermediate size)")
    a.add_argument("--top-k", type=int, default=6, help="k: experts active per token, 1 <= k <= E")
    a.add_argument("--tokens", type=int, default=16384, help="calibration tokens for clustering and the router fit")
    a.add_argument("--out", default=None,
                   help="model folder (default: ~/.cache/specdistill/models/<target>-moefied-e<E>k<k>)")
    a.add_argument("--target", default=DEFAULT_TARGET, help="a dense Llama-family model: local folder or embedded:*")
    a.add_argument("--data", default="embedded:sharegpt")
    a.add_argument("--max-rows", type=int, default=3000, help="conversations read from --data")
    a.add_argument("--max-length", type=int, default=512, help="tokens per conversation")
    a.add_argument("--heldout-size", type=int, default=32, help="held-out conversations for perplexity / agreement")
    a.add_argument("--subset-tokens", type=int, default=6144, help="tokens each of the code and chat subsets gets")
    a.add_argument("--recall-tokens", type=int, default=4096, help="held-out tokens for the routers' top-k recall")
    a.add_argument("--batch-size", type=int, default=4)
    a.add_argument("--router-spread", type=float, default=0.05, help="per-token std of router logits (see convert.py)")
    a.add_argument("--kmeans-iters", type=int, default=25)
    a.add_argument("--ridge", type=float, default=1e-3)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--dtype", default="float32")
    a.add_argument("--cache-dir", default="~/.cache/specdistill/data", help="tokenized data cache")
    a.add_argument("--threads", type=int, default=None)
    a.add_argument("--force", action="store_true", help="rebuild even when the folder matches the inputs")
    args = a.parse_args(argv)
    from specdistill.moe.convert import MoefyConfig

    try:
        args.settings = MoefyConfig(num_experts=args.experts, top_k=args.top_k, tokens=args.tokens,
                                    kmeans_iters=args.kmeans_iters, router_spread=args.router_spread,
                                    ridge=args.ridge, seed=args.seed)
    except ValueError as e:
        a.error(str(e))
    if min(args.max_rows, args.max_length, args.heldout_size, args.subset_tokens, args.recall_tokens,
           args.batch_size) < 1:
        a.error("--max-rows, --max-length, --heldout-size, --subset-tokens, --recall-tokens and --batch-size "
                "must be >= 1")
    args.error = a.error
    return args


def default_out(target: str, E: int, k: int) -> Path:
    from specdistill.assets import CACHE_ROOT, is_embedded

    name = target.split(":", 1)[1] if is_embedded(target) else Path(target).expanduser().resolve().name
    return CACHE_ROOT / "models" / f"{name}-moefied-e{E}k{k}"


def model_source_id(folder: str) -> dict:
    """What identifies a model folder's weights without hashing gigabytes: names, sizes and mtimes."""
    p = Path(folder)
    files = sorted(list(p.glob("*.safetensors")) + list(p.glob("*.bin")) + [p / "config.json"])
    return {"path": str(p.resolve()), "files": [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files
                                                if f.exists()]}


def inputs_key(args, model_folder: str, data_fingerprint: str) -> tuple[str, dict]:
    inputs = {"version": CONVERTER_VERSION, "target": args.target, "weights": model_source_id(model_folder),
              "data": args.data, "data_fingerprint": data_fingerprint, "settings": asdict(args.settings),
              "eval": {k: getattr(args, k) for k in ("heldout_size", "subset_tokens", "recall_tokens", "batch_size",
                                                     "dtype", "max_rows", "max_length")}}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16], inputs


def cached(out: Path, key: str) -> bool:
    meta = out / "moefy.json"
    if not (meta.exists() and (out / "config.json").exists() and any(out.glob("*.safetensors"))):
        return False
    try:
        return json.loads(meta.read_text()).get("key") == key
    except json.JSONDecodeError:
        return False


def take_rows(rows, start: int, max_tokens: int) -> tuple[list[dict], int]:
    """Rows from `start` on until they hold `max_tokens` tokens -> (rows, index after the last one taken)."""
    out, n, i = [], 0, start
    while i < len(rows) and n < max_tokens:
        out.append(rows[i])
        n += len(rows[i]["input_ids"])
        i += 1
    return out, i


def split_subsets(rows, start: int, tokenizer, max_tokens: int) -> dict[str, list[dict]]:
    """Code-like and chat conversations from rows[start:], each subset up to `max_tokens` tokens."""
    from specdistill.moe.realness import is_code_like

    subsets, tokens = {"code": [], "chat": []}, {"code": 0, "chat": 0}
    for i in range(start, len(rows)):
        if min(tokens.values()) >= max_tokens:
            break
        row = rows[i]
        kind = "code" if is_code_like(tokenizer.decode(row["input_ids"])) else "chat"
        if tokens[kind] < max_tokens:
            subsets[kind].append(row)
            tokens[kind] += len(row["input_ids"])
    return subsets


def run(args) -> Path:
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig

    from specdistill.assets import save_model_folder
    from specdistill.config import DataConfig
    from specdistill.data.dataset import build_data
    from specdistill.models.target import load_causal_lm, load_tokenizer, locate_model
    from specdistill.moe.convert import capture_mlp_inputs, moefy
    from specdistill.moe.profiler import calibration_batches
    from specdistill.moe.realness import realness_report
    from specdistill.tokens import pad_id

    t0 = time.perf_counter()
    cfg = args.settings
    out = Path(args.out).expanduser() if args.out else default_out(args.target, cfg.num_experts, cfg.top_k)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        args.error(f"--out {out} is a non-empty folder that holds no model: it would be replaced; choose a new or "
                   "empty folder")
    folder = locate_model(args.target)
    dense_cfg = AutoConfig.from_pretrained(folder)
    try:
        cfg.check_intermediate(getattr(dense_cfg, "intermediate_size", 0) or 0)
    except ValueError as e:
        args.error(f"{e} (target {args.target})")

    tok = load_tokenizer(args.target)
    data = build_data(DataConfig(path=args.data, max_rows=args.max_rows, max_length=args.max_length,
                                 heldout_size=args.heldout_size, seed=args.seed, cache_dir=args.cache_dir), tok)
    key, inputs = inputs_key(args, folder, data.fingerprint)
    if not args.force and cached(out, key):
        print(f"[moefy] {out} already holds this conversion (key {key}); reusing it (--force rebuilds)")
        print((out / "realness.md").read_text() if (out / "realness.md").exists() else "")
        return out

    pad = pad_id(tok)

    def batches(rows: list[dict]) -> list[dict]:
        return calibration_batches(rows, pad, len(rows), args.batch_size)

    train = data.train
    calib_rows, after = take_rows(train, 0, cfg.tokens)
    subsets = split_subsets(train, after, tok, args.subset_tokens)
    heldout = batches(list(data.heldout))
    if not heldout:
        args.error(f"--data {args.data} left no held-out conversations: raise --heldout-size or --max-rows")
    print(f"[moefy] {args.target}: {dense_cfg.num_hidden_layers} layers, intermediate {dense_cfg.intermediate_size} "
          f"-> {cfg.num_experts} experts x {dense_cfg.intermediate_size // cfg.num_experts}, top-{cfg.top_k}; "
          f"calibration {sum(len(r['input_ids']) for r in calib_rows)} tokens from {len(calib_rows)} conversations",
          flush=True)
    bar = partial(tqdm, dynamic_ncols=True, file=sys.stderr)

    dense = load_causal_lm(args.target, args.dtype)
    t_conv = time.perf_counter()
    conv = moefy(dense, batches(calib_rows), cfg, tqdm_factory=bar)
    save_model_folder(conv.model, tok, out)
    t_conv = time.perf_counter() - t_conv
    del conv.model

    t_rep = time.perf_counter()
    moe = load_causal_lm(str(out), args.dtype)  # score what is on disk
    dense_inputs = capture_mlp_inputs(dense, heldout, args.recall_tokens)
    sub = {k: batches(v) for k, v in subsets.items()}
    ticks = len(heldout) + len(sub["code"]) + len(sub["chat"])
    with bar(total=ticks, desc="realness report", unit="batch") as b:
        report = realness_report(dense, moe, heldout, sub, dense_inputs, progress=b.update)
    t_rep = time.perf_counter() - t_rep

    (out / "realness.json").write_text(json.dumps(report.to_dict(), indent=1))
    (out / "realness.md").write_text(report.markdown())
    meta = {"key": key, "inputs": inputs, "conversion": conv.summary(),
            "seconds": {"conversion": round(t_conv, 1), "report": round(t_rep, 1),
                        "total": round(time.perf_counter() - t0, 1)},
            "threads": torch.get_num_threads(), "command": " ".join(sys.argv)}
    (out / "moefy.json").write_text(json.dumps(meta, indent=1))  # written last: it marks the folder complete
    print(report.markdown())
    print(f"[moefy] wrote {out} (conversion {t_conv:.0f} s, report {t_rep:.0f} s)")
    return out


def main(argv=None) -> Path:
    from specdistill.threads import configure_threads

    args = parse_args(argv)
    configure_threads(args.threads, "--threads")
    return run(args)


if __name__ == "__main__":
    main()
