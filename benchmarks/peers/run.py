"""The peers benchmark, one command: the same EAGLE-3 head trained by specdistill, speculators, SpecForge and ModelOpt
on the same regenerated store, converted to the vLLM midlayer format and scored by specdistill's evaluator.

    python -m benchmarks.peers.run --tiny                       # whole pipeline on a tiny random Llama, ~minutes
    python -m benchmarks.peers.run --epochs 6                   # SmolLM2-135M-Instruct, equal loss tokens
    python -m benchmarks.peers.run --epochs 100 --wall-seconds 1800   # equal wall time: 30 min of training each

Steps (docs/peers.md): install the peers' venvs (install.py) -> train specdistill's head with recipe=eagle3_serve,
which writes the store -> write the store in each peer's format (writers.py) -> train every arm in its peer's venv
(peer_train.py) -> convert each head to our vLLM export with the target's embeddings (converters.py) -> evaluate each
export with scripts/evaluate.py -> results.json, results.md and peers.png in --out, with the command that made them.
ModelOpt's heads, which the served layout holds only approximately, are also scored by ModelOpt's own validator
(HFARValidation.validate_online, in its venv after training) on the first --peer-validator-prompts of the evaluator's
prompts at the primary gamma: a separate section of results.md, its own metric, beside our evaluator's tau.
Budgets: --epochs E gives every arm E passes over the same rows (equal loss tokens); --wall-seconds S also stops
every arm's training after S seconds of training (equal wall time: specdistill through trainer.max_minutes, the peers
through a deadline in peer_train.py).
Scoring: every --temperatures x --gammas setting at --eval-batch-size (default 1). With several gammas the report names,
per arm and temperature, the gamma with the highest measured speedup (the evaluator's own `speedup`); --best-gamma
scores gammas 1..6 when --gammas is not given. Speedups are comparable only at batch 1, so at another batch size no
gamma is named best.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from benchmarks.peers import arms, install
from benchmarks.peers.arms import HeadShape
from specdistill.cache import file_digest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PRIMARY_GAMMA = 4  # the default gamma, and the primary table's under --best-gamma when it is scored
VALIDATED_PEERS = ("modelopt",)  # peers whose own validator scores their heads (peer_train.py, spec["validate"])
BEST_GAMMA_CANDIDATES = (1, 2, 3, 4, 5, 6)  # what --best-gamma scores when --gammas is not given


def log(msg: str) -> None:
    print(f"[peers] {msg}", flush=True)


def child_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "WANDB_MODE": "offline",
            "HF_HUB_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_logged(cmd: list[str], logfile: Path, threads: int, timeout: float | None = None) -> tuple[int, float]:
    """Run cmd niced, output into logfile; returns (rc, wall seconds)."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with logfile.open("w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(["nice", "-n", "19", *cmd], stdout=f, stderr=subprocess.STDOUT, env=child_env(threads),
                                cwd=REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


@dataclass(frozen=True)
class Ran:
    """One cached step's outcome: its exit status, its seconds (those of the run that made it, when reused), and
    whether it was reused."""
    rc: int
    wall_s: Optional[float]
    reused: bool


def run_or_reuse(cmd: list[str], inputs: dict, result: Path, logfile: Path, threads: int, *, done: Path,
                 wall_key: str) -> Ran:
    """Run cmd (its output into logfile) unless `result` was written by a run of the same `inputs`: `done` holds the
    inputs of the run that wrote it (and its seconds under wall_key), and is written only once that run succeeded."""
    if result.exists() and done.exists():
        made = json.loads(done.read_text())
        if made["inputs"] == inputs:
            return Ran(0, made.get(wall_key), reused=True)
    done.unlink(missing_ok=True)
    result.unlink(missing_ok=True)  # made from other inputs: never read back after a run that fails to replace it
    rc, wall = run_logged(cmd, logfile, threads)
    if rc == 0 and result.exists():
        done.write_text(json.dumps({"inputs": inputs, wall_key: wall}, indent=1))
    return Ran(rc, wall, reused=False)


def tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


# --------------------------------------------------------------------------------------------------------- target
def make_tiny_target(folder: Path) -> Path:
    """A random 4-layer Llama (hidden 64) with SmolLM2's tokenizer and chat template: real prompts, seconds to run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdistill.assets import resolve_model_path

    if (folder / "config.json").exists():
        return folder
    src = Path(resolve_model_path("embedded:smollm2-135m-instruct"))
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation_config")):
            shutil.copy(f, folder / f.name)
    torch.manual_seed(0)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def tiny_shape(target: Path) -> HeadShape:
    from specdistill.drafts.eagle3.model import default_aux_layer_ids

    c = json.loads((target / "config.json").read_text())
    return HeadShape(aux_layer_ids=tuple(default_aux_layer_ids(c["num_hidden_layers"])), draft_vocab_size=512,
                     intermediate_size=c["intermediate_size"], num_attention_heads=c["num_attention_heads"],
                     num_key_value_heads=c["num_key_value_heads"])


# ----------------------------------------------------------------------------------------------------- our arm
def variant_name(overrides: list[str]) -> str:
    """The arm name of a specdistill variant, also its folder and a Hydra value: specdistill_<key>_<value>... with
    each key's last part and anything but letters, digits and dots in a value written as '_'."""
    parts = []
    for o in overrides:
        if "=" not in o:
            raise SystemExit(f"--ours-variant {o!r}: write each override as key=value (e.g. trainer.optimizer=muon)")
        key, value = o.split("=", 1)
        parts.append(key.lstrip("+~").split(".")[-1] + "_" + re.sub(r"[^A-Za-z0-9.]", "_", value))
    return "specdistill_" + "_".join(parts)


def train_ours(a, target: str, shape: HeadShape, out: Path, name: str = "specdistill",
               variant: tuple[str, ...] = ()) -> dict:
    """recipe=eagle3_serve on the target: regenerates (or reuses) the store, trains, exports. Its final evaluation is
    left to the common scoring step. A variant (--ours-variant) adds its Hydra overrides last: the same store (the
    regeneration cache is keyed by its inputs), the same head, one setting changed."""
    run_dir = out / "arms" / name
    over = [f"target.path={target}", "target=local", f"run_name=peers_{name}", f"trainer.output_dir={run_dir}",
            f"trainer.epochs={a.epochs}", f"data.regenerate.max_prompts={a.prompts}", "eval.spec_eval=false",
            f"draft.draft_vocab_size={shape.draft_vocab_size}", f"draft.intermediate_size={shape.intermediate_size}",
            f"target.aux_layer_ids=[{','.join(str(k) for k in shape.aux_layer_ids)}]", "trainer.export_formats=[vllm]",
            f"trainer.threads={a.threads}", "trainer.resume=auto"]
    if a.wall_seconds:
        over.append(f"trainer.max_minutes={a.wall_seconds / 60:.6g}")
    if a.tiny:
        over += ["data.regenerate.max_new_tokens=24", "data.regenerate.batch_size=8", "trainer.micro_batch_size=4",
                 "trainer.eval_every=0", "trainer.save_every=2", "data.heldout_size=4", "eval.max_batches=1"]
    # the settings every arm shares (arms.OURS), whatever the recipe's defaults; --tiny's and a variant's values win
    shared = {"trainer.micro_batch_size": arms.OURS.rows_per_step, "trainer.warmup_steps": arms.OURS.warmup_steps}
    over += [f"{k}={v}" for k, v in shared.items() if not any(o.startswith(f"{k}=") for o in over + list(variant))]
    cmd = [sys.executable, str(REPO / "train.py"), "recipe=eagle3_serve", *over, *variant]
    log(f"{name}: " + shlex.join(cmd))
    logfile = out / "logs" / f"{name}.log"
    rc, wall = run_logged(cmd, logfile, a.threads)
    if rc != 0:
        raise SystemExit(f"{name}'s run failed (rc {rc}); its log ends:\n{tail(logfile)}")
    summary = json.loads((run_dir / "summary.json").read_text())
    report = json.loads((run_dir / "data_report.json").read_text())
    logs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"tokens_seen"' in x]
    points = []
    for ck in sorted((run_dir / "checkpoints").glob("step-*")):
        n = int(ck.name.split("-")[1])
        seen = [x for x in logs if x["step"] <= n]
        if seen and (ck / "draft").exists():
            points.append({"step": n, "dir": str(ck / "draft"), "train_s": seen[-1]["wall_s"],
                           "loss_tokens": seen[-1]["tokens_seen"]})
    return {"command": shlex.join(cmd), "wall_s": summary.get("wall_s"), "process_s": wall, "run_dir": str(run_dir),
            "loss_tokens": logs[-1]["tokens_seen"] if logs else None, "points": points,
            "export": str(run_dir / "export" / "vllm"), "store": report["source"].removeprefix("regenerated:"),
            "heldout": report.get("heldout_examples", 0), "train_loss_tokens": report.get("train_loss_tokens"),
            "steps": summary.get("step")}


# ------------------------------------------------------------------------------------------------------- peer data
def write_peer_data(a, ours: dict, target: str, out: Path, peers: list[str]) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from benchmarks.peers import writers

    rows = writers.read_rows(ours["store"])
    train, held = rows[: len(rows) - ours["heldout"]], rows[len(rows) - ours["heldout"]:]
    sd = load_file(str(Path(ours["export"]) / "model.safetensors"))
    d2t, t2d = sd["d2t"], sd["t2d"]  # the same draft vocabulary for every arm
    source = {"store": ours["store"], "rows": len(train), "held": len(held),
              "d2t": hashlib.sha256(d2t.numpy().tobytes()).hexdigest()[:16]}

    def cached(peer: str, make) -> dict:
        """The peer's data folder, written again only when the store, the rows or the vocabulary changed."""
        folder = out / "data" / peer
        meta, src = folder / "specdistill_peer_data.json", folder / "source.json"
        if meta.exists() and src.exists() and json.loads(src.read_text()) == source:
            log(f"[peers/data] {peer}: reusing {folder}")
            return json.loads(meta.read_text())
        if folder.exists():
            shutil.rmtree(folder)
        made = make(folder)
        src.write_text(json.dumps(source))
        return made

    def speculators_data(folder: Path) -> dict:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()  # its final norm only
        return writers.write_speculators(train, held, folder, model, d2t, t2d, log=log)

    data = {}
    if "speculators" in peers:
        data["speculators"] = {**cached("speculators", speculators_data), "root": str(out / "data" / "speculators")}
    if "specforge" in peers:
        data["specforge"] = cached("specforge", lambda f: writers.write_specforge(train, f, d2t, t2d, log=log))
    if "modelopt" in peers:
        data["modelopt"] = cached("modelopt", lambda f: writers.write_modelopt(train, f, d2t, log=log))
    lengths = [len(r.ids) for r in train]
    return {"data": data, "rows": len(train), "loss_tokens": writers.answer_tokens(train),
            "mean_len": sum(lengths) / len(lengths), "max_len": max(lengths), "first_row": train[0]}


def validator_prompt_ids(tokenizer, count: int, eval_prompts: int, max_new_tokens: int,
                         context: Optional[int]) -> list[list[int]]:
    """The first `count` (at most eval_prompts) of the prompts scripts/evaluate.py scores at the benchmark's settings:
    the evaluator's eval.prompts (embedded:mt_bench) through specdistill.data.prompts.load_prompts with its chat
    template, eval.max_prompt_tokens (longer prompts skipped) and the target's context. [] when count < 1."""
    from specdistill.config import EvalConfig
    from specdistill.data.prompts import load_prompts

    if count < 1:
        return []
    defaults = EvalConfig()
    return load_prompts(defaults.prompts, tokenizer, num_prompts=min(count, eval_prompts),
                        max_new_tokens=max_new_tokens, context=context,
                        max_prompt_tokens=defaults.max_prompt_tokens).ids


def validate_block(peer: str, prompt_ids: list[list[int]], gamma: int, max_new_tokens: int) -> Optional[dict]:
    """spec["validate"] for an arm of `peer`: the prompts, gamma and new tokens its own validator runs; None for a
    peer without one (VALIDATED_PEERS) or with no prompts (--peer-validator-prompts 0)."""
    if peer not in VALIDATED_PEERS or not prompt_ids:
        return None
    return {"prompt_ids": [list(p) for p in prompt_ids], "gamma": gamma, "max_new_tokens": max_new_tokens}


def peer_spec(a, peer: str, kind: str, shape: HeadShape, target: str, pdata: dict, out: Path,
              validator_ids: list[list[int]]) -> dict:
    """The spec peer_train.py reads for one arm; a ModelOpt arm's carries "validate" (validate_block) when
    validator_ids is not empty: the primary gamma (a.gammas[0]) and --eval-tokens new tokens."""
    s = arms.settings_for(peer, kind)
    tokens_per_step = s.tokens_per_step or max(pdata["max_len"], int(s.rows_per_step * pdata["mean_len"]))
    spec = {"peer": peer, "arm": kind, "settings": asdict(s), "shape": asdict(shape), "target": target,
            "data": pdata["data"][peer], "out": str(out / "arms" / f"{peer}-{kind}"), "epochs": a.epochs,
            "seed": a.seed, "wall_seconds": a.wall_seconds,
            "draft_vocab_size": shape.draft_vocab_size, "peer_aux_ids": arms.peer_aux_ids(peer, shape.aux_layer_ids),
            "tokens_per_step": tokens_per_step, "max_len": pdata["max_len"], "threads": a.threads}
    validate = validate_block(peer, validator_ids, a.gammas[0], a.eval_tokens)
    if validate:
        spec["validate"] = validate
    return spec


def data_digest(out: Path, peer: str, pdata_peer: dict) -> str:
    """What a peer arm's training data is: its data folder's source.json (store, rows, vocabulary) and metadata."""
    src = out / "data" / peer / "source.json"
    return (src.read_text() if src.exists() else "") + json.dumps(pdata_peer, sort_keys=True, default=str)


def arm_is_done(arm_dir: Path, spec: dict, inputs: dict) -> bool:
    """A peer arm trained before with this exact spec and these inputs (code, data) has its results on disk."""
    done = arm_dir / "done.json"
    return (done.exists() and (arm_dir / "train_report.json").exists() and (arm_dir / "head").exists()
            and {k: v for k, v in json.loads(done.read_text()).items() if k in ("spec", "inputs")}
            == json.loads(json.dumps({"spec": spec, "inputs": inputs})))  # as JSON reads it back: tuples are lists


def train_peer(a, peer: str, kind: str, shape: HeadShape, target: str, pdata: dict, out: Path,
               validator_ids: list[list[int]]) -> dict:
    """Train one arm in its peer's venv; an arm finished before with the same spec, peer_train.py, shims and data is
    reused (done.json), any change trains it again."""
    spec = peer_spec(a, peer, kind, shape, target, pdata, out, validator_ids)
    arm_dir = Path(spec["out"])
    arm_dir.mkdir(parents=True, exist_ok=True)
    spec_file = arm_dir / "spec.json"
    inputs = {"peer_train": file_digest(HERE / "peer_train.py"),
              "shims": {f.name: file_digest(f) for f in sorted((HERE / "shims").glob("*.py"))},
              "data": data_digest(out, peer, pdata["data"][peer])}
    cmd = [str(install.venv_python(peer)), str(HERE / "peer_train.py"), str(spec_file)]
    if arm_is_done(arm_dir, spec, inputs):
        log(f"{peer}/{kind}: reusing the arm trained before with the same spec and inputs ({arm_dir})")
        rc, wall = 0, json.loads((arm_dir / "done.json").read_text()).get("process_s")
    else:
        (arm_dir / "done.json").unlink(missing_ok=True)
        (arm_dir / "validate.json").unlink(missing_ok=True)  # only this run's validator result is read back
        spec_file.write_text(json.dumps(spec, indent=1))
        log(f"{peer}/{kind}: " + shlex.join(cmd))
        rc, wall = run_logged(cmd, out / "logs" / f"{peer}-{kind}.log", a.threads, timeout=a.arm_timeout)
        if rc == 0:
            (arm_dir / "done.json").write_text(json.dumps({"spec": spec, "inputs": inputs, "process_s": wall},
                                                          indent=1))
    rec = {"command": shlex.join(cmd), "rc": rc, "process_s": wall, "arm_dir": str(arm_dir)}
    if rc != 0:
        rec["error"] = tail(out / "logs" / f"{peer}-{kind}.log")
        log(f"{peer}/{kind} failed (rc {rc}):\n{rec['error']}")
        return rec
    rec.update(json.loads((arm_dir / "train_report.json").read_text()))
    if "validate" in spec:
        found = arm_dir / "validate.json"
        rec["peer_validator"] = (json.loads(found.read_text()) if found.exists()
                                 else {"error": f"peer_train.py wrote no {found.name}"})
        v = rec["peer_validator"]
        log(f"{peer}/{kind}: its own validator: "
            + (f"mean AR {v['mean_ar']:.4f}" if "mean_ar" in v else f"failed: {v.get('error')}"))
    return rec


def convert_folder(peer: str, head_dir: Path, export_dir: Path, target: str, target_model) -> dict:
    from benchmarks.peers.converters import CONVERTERS, export_converted, read_peer_head

    sd, config = read_peer_head(head_dir)
    return export_converted(CONVERTERS[peer](sd, config), target_model, target, export_dir)


def per_second(rec: dict) -> Optional[float]:
    """Loss tokens the arm trained on (its own count) per second of its training."""
    return rec["loss_tokens"] / rec["wall_s"] if rec.get("loss_tokens") and rec.get("wall_s") else None


def convert_peer(peer: str, rec: dict, target: str, target_model, probe_row) -> dict:
    """The peer's head as our vLLM export, and how often it predicts what the peer's own forward predicts on the
    first training row (probe.json from peer_train.py)."""
    from benchmarks.peers.converters import agreement

    res = convert_folder(peer, Path(rec["arm_dir"]) / "head", Path(rec["arm_dir"]) / "export_vllm", target,
                         target_model)
    head = res.pop("_head")
    probe = json.loads((Path(rec["arm_dir"]) / "probe.json").read_text()) if (Path(rec["arm_dir"]) /
                                                                              "probe.json").exists() else {}
    if "draft_argmax" in probe:
        res["agreement_with_peer_forward"] = agreement(head, probe_row.ids, probe_row.aux, probe["draft_argmax"])
    else:
        res["agreement_with_peer_forward"] = None
        res["probe_error"] = probe.get("error", "no probe.json")
    return res


def is_ours(name: str) -> bool:
    """specdistill's arm or one of its --ours-variant arms."""
    return name == "specdistill" or name.startswith("specdistill_")


def arm_export(name: str, rec: dict) -> Optional[str]:
    """The vLLM export an arm is scored on: specdistill's own, or the peer head converted."""
    return rec.get("export") if is_ours(name) else (rec.get("conversion") or {}).get("export")


def temperature_key(temperature: float) -> str:
    return f"T{temperature:g}"


def setting_key(temperature: float, gamma: int) -> str:
    return f"{temperature_key(temperature)}-g{gamma}"


def scored_gammas(gammas: Optional[list[int]], best_gamma: bool) -> list[int]:
    """The gammas every arm is scored at, the primary table's first: --gammas as given (default [4]); with
    --best-gamma, BEST_GAMMA_CANDIDATES when --gammas is not given, and 4 moved first when it is among them."""
    if gammas is None:
        gammas = list(BEST_GAMMA_CANDIDATES) if best_gamma else [PRIMARY_GAMMA]
    gammas = list(dict.fromkeys(gammas))
    if best_gamma and PRIMARY_GAMMA in gammas:
        gammas.remove(PRIMARY_GAMMA)
        gammas.insert(0, PRIMARY_GAMMA)
    return gammas


def eval_command(target: str, export: str, eval_dir: Path, *, prompts: int, tokens: int, gamma: int,
                 temperature: float, batch_size: int) -> list[str]:
    """scripts/evaluate.py on one export at one setting; batch_size is the measured pass's and the sweep's only one."""
    return [sys.executable, str(REPO / "scripts" / "evaluate.py"), "target=local", f"target.path={target}",
            f"eval.draft_path={export}", f"eval.num_prompts={prompts}", f"eval.max_new_tokens={tokens}",
            f"eval.gamma={gamma}", f"eval.temperature={temperature}", f"eval.batch_size={batch_size}",
            f"eval.batch_sizes=[{batch_size}]", f"eval.output_dir={eval_dir}", "eval.overwrite=true"]


def evaluate(a, name: str, export: str, target: str, out: Path, temperature: float, gamma: int,
             eval_dir: Optional[Path] = None, prompts: Optional[int] = None) -> dict:
    key = setting_key(temperature, gamma)
    eval_dir = eval_dir or out / "eval" / key / name
    logfile = out / "logs" / f"eval-{'-'.join(eval_dir.relative_to(out).parts)}.log"
    cmd = eval_command(target, export, eval_dir, prompts=prompts or a.eval_prompts, tokens=a.eval_tokens,
                       gamma=gamma, temperature=temperature, batch_size=a.eval_batch_size)
    weights = Path(export) / "model.safetensors"
    inputs = {"command": cmd, "export": file_digest(weights) if weights.exists() else None}
    ran = run_or_reuse(cmd, inputs, eval_dir / "results.json", logfile, a.threads,
                       done=eval_dir / "peers_inputs.json", wall_key="eval_s")
    if ran.reused:
        log(f"{name}: reusing the evaluation made before of the same export and settings ({eval_dir})")
    if ran.rc != 0:
        return {"command": shlex.join(cmd), "rc": ran.rc, "error": tail(logfile)}
    wall = ran.wall_s
    r = json.loads((eval_dir / "results.json").read_text())
    return {"command": shlex.join(cmd), "rc": 0, "tau": r["mean_accept_len"], "speedup": r.get("speedup"),
            "batch_size": r.get("batch_size"), "dir": str(eval_dir), "accept_rate_per_pos": r["accept_rate_per_pos"],
            "greedy_mismatches": r.get("greedy_mismatches"), "eval_s": wall}


# ----------------------------------------------------------------------------------------------------- best gamma
@dataclass(frozen=True)
class GammaPick:
    """The gamma with the highest measured speedup of one arm at one temperature, and its tau."""
    gamma: int
    speedup: float
    tau: float


def measured_speedup(e: dict) -> Optional[float]:
    """The evaluator's speedup of one eval record, None when it has none (a failed eval, a NaN written as null)."""
    s = e.get("speedup")
    return float(s) if isinstance(s, (int, float)) and math.isfinite(s) else None


def pick_best_gamma(evals: dict, temperature: float, gammas: list[int]) -> Optional[GammaPick]:
    """Among an arm's evals at this temperature, the gamma with the highest measured speedup (a tie: the shorter
    gamma); None when no gamma has one."""
    picks = []
    for g in gammas:
        e = evals.get(setting_key(temperature, g)) or {}
        speedup = measured_speedup(e)
        if speedup is not None:
            picks.append(GammaPick(gamma=g, speedup=speedup, tau=e["tau"]))
    return max(picks, key=lambda p: (p.speedup, -p.gamma), default=None)


def best_gamma_refusal(gammas: list[int], batch_size: int) -> Optional[str]:
    """Why no gamma can be named best, or None when one can."""
    if batch_size != 1:
        return (f"the evals ran at batch size {batch_size}; speedups measured at batch > 1 are not what a batch-1 "
                "user sees, so no gamma is named best (rerun with --eval-batch-size 1)")
    if len(gammas) < 2:
        return f"only gamma {gammas[0]} was scored (pass several with --gammas, or --best-gamma)"
    return None


def pick_best_gammas(results: dict, temperatures: list[float], gammas: list[int], batch_size: int) -> dict:
    """rec["best_gamma"][T<t>] = {gamma, speedup, tau} for every arm and temperature with a measured speedup;
    returns what results["best_gamma"] records: the candidates, the batch size and why no pick was made (or None)."""
    refusal = best_gamma_refusal(gammas, batch_size)
    if refusal:
        log(f"best gamma not picked: {refusal}")
    else:
        for name, rec in results["arms"].items():
            picks = {temperature_key(t): pick_best_gamma(rec.get("evals") or {}, t, gammas) for t in temperatures}
            rec["best_gamma"] = {k: asdict(p) for k, p in picks.items() if p is not None}
            for k, p in picks.items():
                log(f"{name} at {k}: best gamma {p.gamma} (speedup {p.speedup:.3f}, tau {p.tau:.3f})" if p
                    else f"{name} at {k}: no measured speedup, no best gamma")
    return {"gammas": list(gammas), "temperatures": list(temperatures), "batch_size": batch_size,
            "skipped": refusal}


def best_gamma_lines(results: dict) -> list[str]:
    """results.md's "Best gamma per arm" section: the pick per arm and temperature beside every gamma's speedup, or
    why no pick was made."""
    bg = results["best_gamma"]
    lines = ["", "## Best gamma per arm (measured speedup)", ""]
    if bg.get("skipped"):
        return lines + [f"Not picked: {bg['skipped']}."]
    gammas = sorted(bg["gammas"])
    lines += ["Per arm and temperature, the scored gamma with the highest speedup the evaluator measured (tokens/s "
              "of speculative over target-only decoding, same prompts, batch 1; a tie goes to the shorter gamma).", "",
              f"| arm | T | best gamma | speedup | tau | speedup at gamma {', '.join(str(g) for g in gammas)} |",
              "|---|---|---|---|---|---|"]
    for name, rec in results["arms"].items():
        evals = rec.get("evals") or {}
        for t in bg["temperatures"]:
            speeds = [measured_speedup(evals.get(setting_key(t, g)) or {}) for g in gammas]
            row = ", ".join("-" if s is None else f"{s:.3f}" for s in speeds)
            p = (rec.get("best_gamma") or {}).get(temperature_key(t))
            pick = f"{p['gamma']} | {p['speedup']:.3f} | {p['tau']:.4f}" if p else "none: no measured speedup | - | -"
            lines.append(f"| {name} | {t:g} | {pick} | {row} |")
    return lines


def peer_validator_lines(results: dict) -> list[str]:
    """results.md's section for the arms scored by their peer's own validator (rec["peer_validator"], validate.json
    from peer_train.py): its mean AR beside our evaluator's tau of the converted head at T=0 and the same gamma."""
    rows = {n: r["peer_validator"] for n, r in results["arms"].items() if r.get("peer_validator")}
    if not rows:
        return []
    lines = ["", "## ModelOpt's own validator (its forward, its metric)", "",
             "ModelOpt's `HFARValidation.validate_online` on each ModelOpt head as ModelOpt trained it (its EAGLE "
             "forward, the first layer's input_layernorm included, which the served layout drops), not on the "
             "converted export: greedy speculative decoding against the target, a chain of gamma drafts per round, "
             "the first prompts of the evaluator's MT-bench set, max_new_tokens tokens each with no stop at EOS, "
             "batch 1. Its AR counts 1 + accepted drafts per round, its rounds restart after each correction token, "
             "and 'mean AR' is the mean of the per-prompt ratios. A different measurement from tau (our decoder on "
             "the converted head: generated tokens over rounds, pooled over the prompts); they stand side by side, "
             "not as one number measured twice.", "",
             "| arm | its mean AR | prompts | gamma | new tokens | validator wall s | "
             "our evaluator's tau, converted head |",
             "|---|---|---|---|---|---|---|"]
    for name, v in rows.items():
        gamma = v.get("gamma")
        key = setting_key(0.0, gamma) if gamma is not None else None
        e = ((results["arms"][name].get("evals") or {}).get(key) or {}) if key else {}
        tau = f"{e['tau']:.4f} ({key})" if "tau" in e else (f"not scored at {key}" if key else "-")
        ar = f"{v['mean_ar']:.4f}" if "mean_ar" in v else f"failed: {str(v.get('error'))[-80:]!r}"
        secs = f"{v['seconds']:.0f}" if isinstance(v.get("seconds"), (int, float)) else "-"
        lines.append(f"| {name} | {ar} | {v.get('prompts', '-')} | {gamma if gamma is not None else '-'} | "
                     f"{v.get('max_new_tokens', '-')} | {secs} | {tau} |")
    return lines


@dataclass(frozen=True)
class OursOverPeer:
    """Our head's tau over one peer arm's at one setting, paired over the same prompts."""
    arm: str
    ratio: float
    lo: Optional[float]
    hi: Optional[float]


def ours_over_peers(results: dict, key: str) -> list[OursOverPeer]:
    """ours / peer for every scored peer arm at `key`, inverted from the paired table's peer / ours ratio and its
    interval (a monotone map, so the bounds swap)."""
    cmp = (results.get("paired") or {}).get(key) or {}
    out = []
    for name, e in (cmp.get("overall") or {}).items():
        r = e.get("ratio_to_baseline")
        if is_ours(name) or not r:
            continue
        ci = e.get("ratio_ci95")
        lo, hi = (1 / ci[1], 1 / ci[0]) if ci and ci[0] > 0 else (None, None)
        out.append(OursOverPeer(name, 1 / r, lo, hi))
    return out


def ours_over_peers_lines(results: dict) -> list[str]:
    """results.md's "Ours over each peer arm" section: tau ratio (with its paired interval) at the budget this run
    used (equal loss tokens, or equal wall time with --wall-seconds) and the training-throughput ratio. Figures only:
    what they are measured against lives in docs/goals.md, not here."""
    key, arms_ = results["settings"][0], results["arms"]
    ours_tps = arms_.get("specdistill", {}).get("loss_tokens_per_s")
    wall = results.get("wall_seconds")
    budget = f"equal wall time, {wall:g} s of training each" if wall else f"equal loss tokens, {results['budget']}"
    lines = ["", "## Ours over each peer arm", "", f"At {key}, {budget}; tau ratio ours / peer = 1 / the peer's "
             "paired ratio to specdistill (interval inverted); throughput ratio = our loss tokens/s over the arm's.",
             "", "| peer arm | tau ours / peer [95% CI] | loss tokens/s ours / peer |", "|---|---|---|"]
    rows = ours_over_peers(results, key)
    if not rows:
        return lines + ["| - | no peer arm was scored and paired | - |"]
    for o in rows:
        ci = f" [{o.lo:.3f}, {o.hi:.3f}]" if o.lo is not None else ""
        tps = arms_.get(o.arm, {}).get("loss_tokens_per_s")
        speed = f"{ours_tps:.1f} / {tps:.1f} = {ours_tps / tps:.2f}x" if ours_tps and tps else "-"
        lines.append(f"| {o.arm} | {o.ratio:.3f}x{ci} | {speed} |")
    return lines


def paired(results: dict, key: str) -> Optional[dict]:
    """Every arm against specdistill's head on the same prompts (specdistill.eval.compare: paired bootstrap)."""
    from specdistill.cli.compare_evals import load_run
    from specdistill.eval.compare import compare

    runs = []
    for name, r in results["arms"].items():
        e = (r.get("evals") or {}).get(key) or {}
        if "dir" in e:
            run = load_run(e["dir"], temperature=float(key[1:].split("-")[0]))
            run.name = name
            runs.append(run)
    if not any(r.name == "specdistill" for r in runs) or len(runs) < 2:
        return None
    return compare(runs, "specdistill")


def serve_in_vllm(a, results: dict, target: str, out: Path) -> None:
    """One head per trainer (specdistill's, and each peer's first scored arm) served by vLLM's CPU build
    (scripts/vllm_check.py in --vllm-python's venv, made by scripts/engine_test.sh): the engine's own tau beside our
    evaluator's at the first setting (vLLM decodes greedily, so only T=0 compares). A run made before of the same
    export, settings and evaluator result is reused."""
    key, seen = results["settings"][0], set()
    for name, rec in results["arms"].items():
        trainer = "specdistill" if is_ours(name) else name.split("-")[0]
        e = (rec.get("evals") or {}).get(key) or {}
        export = arm_export(name, rec)
        if trainer in seen or "dir" not in e or not export:
            continue
        seen.add(trainer)
        res_file = out / "vllm" / f"{name}.json"
        res_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["env", "VLLM_CPU_KVCACHE_SPACE=2", a.vllm_python, str(REPO / "scripts" / "vllm_check.py"), "--target",
               target, "--draft", export, "--num-prompts", str(a.eval_prompts), "--max-tokens", str(a.eval_tokens),
               "--gamma", str(a.gammas[0]), "--out", str(res_file), "--ours", str(Path(e["dir"]) / "results.json")]
        weights, ours_file = Path(export) / "model.safetensors", Path(e["dir"]) / "results.json"
        inputs = {"command": cmd, "export": file_digest(weights) if weights.exists() else None,
                  "ours": file_digest(ours_file) if ours_file.exists() else None}
        ran = run_or_reuse(cmd, inputs, res_file, out / "logs" / f"vllm-{name}.log", a.threads,
                           done=res_file.with_name(f"{name}.inputs.json"), wall_key="s")
        if ran.reused:
            log(f"{name}: reusing vLLM's run made before of the same export and settings ({res_file})")
        rec["vllm"] = {"command": shlex.join(cmd), "rc": ran.rc, "s": ran.wall_s}
        if ran.rc == 0 and res_file.exists():
            r = json.loads(res_file.read_text())
            rec["vllm"].update(tau=r.get("mean_accept_len"), ours_tau=e.get("tau"))
        else:
            rec["vllm"]["error"] = tail(out / "logs" / f"vllm-{name}.log")
        log(f"{name} served by vLLM: tau {rec['vllm'].get('tau')} (our evaluator {e.get('tau')})")


def learning_curves(a, results: dict, target: str, target_model, out: Path) -> None:
    """tau of every arm's epoch-end heads (specdistill: its checkpoints) at the first scoring setting, on
    --curve-prompts prompts: rec["tau_curve"] = [{loss_tokens, train_s, tau}]."""
    t, g = a.temperatures[0], a.gammas[0]
    for name, rec in results["arms"].items():
        curve = []
        for pt in rec.get("points") or []:
            label = f"epoch-{pt['epoch']}" if "epoch" in pt else f"step-{pt['step']}"
            export = pt["dir"]
            if not is_ours(name):
                try:
                    res = convert_folder(name.split("-")[0], Path(pt["dir"]),
                                         Path(rec["arm_dir"]) / "points" / label / "export_vllm", target, target_model)
                    res.pop("_head")
                    export = res["export"]
                except Exception as e:  # a point that does not convert is left out, named in the log
                    log(f"{name} {label}: not converted: {type(e).__name__}: {e}")
                    continue
            e = evaluate(a, name, export, target, out, t, g, eval_dir=out / "curves" / name / label,
                         prompts=a.curve_prompts)
            if "tau" in e:
                curve.append({"label": label, "loss_tokens": pt["loss_tokens"], "train_s": pt["train_s"],
                              "tau": e["tau"]})
        rec["tau_curve"] = curve


def plot_curves(out: Path, results: dict) -> None:
    """peers_curves.png: every arm's tau_curve (learning_curves) through benchmarks.peers.curves' plot."""
    from benchmarks.peers.curves import CurvePoint, plot

    curves = {name: [CurvePoint(run=str(out), loss_tokens=p["loss_tokens"], train_s=p["train_s"], tau=p["tau"],
                                tau_lo=None, tau_hi=None) for p in rec["tau_curve"]]
              for name, rec in results["arms"].items() if rec.get("tau_curve")}
    plot(curves, results["settings"][0], out / "peers_curves.png")


# --------------------------------------------------------------------------------------------------------- report
def write_report(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = [f"# Peers benchmark ({results['mode']})", "", f"Command: `{results['command']}`", "",
             f"Budget: {results['budget']}; {results['rows']} training rows, {results['loss_tokens']} answer (loss) "
             "tokens per epoch, the same for every arm.", "",
             "| arm | tau | a_1..a_4 | loss tokens/s | train wall s | peak RSS MB | agrees with peer forward | "
             "exact in served layout | measured speedup |", "|---|---|---|---|---|---|---|---|---|"]
    primary = results["settings"][0]
    lines[-2:-2] = [f"Scored by specdistill's evaluator at {primary} (T = temperature, g = gamma); every setting's "
                    "paired table follows.", ""]
    for name, r in results["arms"].items():
        e = (r.get("evals") or {}).get(primary) or {}
        acc = ", ".join(f"{x:.3f}" for x in (e.get("accept_rate_per_pos") or [])[:4])
        err = r.get("error") or e.get("error")
        tau = f"{e['tau']:.4f}" if "tau" in e else (f"failed: {str(err)[-80:]!r}" if err else "not scored")
        tps = f"{r['loss_tokens_per_s']:.1f}" if r.get("loss_tokens_per_s") else "-"
        wall = f"{r['wall_s']:.1f}" if r.get("wall_s") else "-"
        rss = f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") else "-"
        exact = r.get("conversion", {}).get("exact", True)
        note = "yes" if exact else "approx: " + "; ".join(x.split(":")[0] for x in r["conversion"]["inexact"])
        agree = r.get("conversion", {}).get("agreement_with_peer_forward")
        agree = "-" if is_ours(name) else (f"{agree:.3f}" if agree is not None else "no probe")
        speedup = measured_speedup(e)
        speedup = "-" if speedup is None else f"{speedup:.3f}"
        lines.append(f"| {name} | {tau} | {acc} | {tps} | {wall} | {rss} | {agree} | {note} | {speedup} |")
    lines += ["", "Loss tokens/s = epochs x answer tokens of the training rows / the trainer's own wall time. tau is "
              "specdistill's evaluator on each head's vLLM export (the target's embeddings), same prompts and gamma. "
              "'agrees with peer forward': the fraction of slots of the first training row where the converted head's "
              "step-0 prediction equals the peer's own forward's (1.000 for an exact conversion)."]
    batch = results.get("eval_batch_size", 1)
    lines += ["", "Measured speedup: the evaluator's tokens/s of speculative over target-only decoding on this "
              f"machine, at eval batch size {batch}. tau does not depend on the batch size; speedup does, and "
              "speedups are comparable only at batch 1"
              + ("." if batch == 1 else f": these ran at batch {batch}, not what a batch-1 user sees.")]
    if results.get("best_gamma"):
        lines += best_gamma_lines(results)
    lines += peer_validator_lines(results)
    if results.get("paired"):
        lines += ours_over_peers_lines(results)
    from specdistill.eval.compare import markdown

    served = {n: r["vllm"] for n, r in results["arms"].items() if r.get("vllm")}
    if served:
        lines += ["", "## Served by vLLM's CPU build (one head per trainer)", "",
                  "| arm | vLLM tau | our evaluator's tau |", "|---|---|---|"]
        lines += [f"| {n} | {v.get('tau', 'failed')} | {v.get('ours_tau', '-')} |" for n, v in served.items()]
    curves = {n: r["tau_curve"] for n, r in results["arms"].items() if r.get("tau_curve")}
    if curves:
        lines += ["", "## Learning curves (peers_curves.png)", "", "| arm | (loss tokens, training s, tau) per point |",
                  "|---|---|"]
        lines += [f"| {n} | " + "; ".join(f"({p['loss_tokens']}, {p['train_s']:.1f}, {p['tau']:.3f})" for p in c)
                  + " |" for n, c in curves.items()]

    for key, cmp in (results.get("paired") or {}).items():
        if cmp:
            lines += [""] + markdown(cmp, f"## {key}: every arm against specdistill (paired)")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [n for n, r in results["arms"].items() if "tau" in ((r.get("evals") or {}).get(primary) or {})]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        ax1.bar(names, [results["arms"][n]["evals"][primary]["tau"] for n in names])
        ax1.set(ylabel="tau", title=f"acceptance length, {primary} (same decoder)")
        ax2.bar(names, [results["arms"][n].get("loss_tokens_per_s") or 0 for n in names])
        ax2.set(ylabel="loss tokens / s", title="training throughput")
        for ax in (ax1, ax2):
            ax.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        fig.savefig(out / "peers.png", dpi=120)
        plt.close(fig)
    except Exception as e:  # the table and JSON stand without the plot
        log(f"plot not written: {e}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama, a few prompts and steps: smoke test")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default outputs/peers[-tiny])")
    ap.add_argument("--peers", nargs="+", default=list(arms.PEERS), choices=arms.PEERS)
    ap.add_argument("--arms", nargs="+", default=list(arms.DEFAULT_ARM_KINDS), choices=arms.ARM_KINDS,
                    help="which arms per peer (default: defaults ours; ours-1row: our settings at one row per step)")
    ap.add_argument("--epochs", type=int, default=None, help="passes over the rows for every arm (equal loss tokens)")
    ap.add_argument("--wall-seconds", type=float, default=None, help="stop each peer arm's training after this long")
    ap.add_argument("--prompts", type=int, default=None, help="regenerated prompts (default 800; tiny 16)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="MT-bench prompts scored (default 80; tiny 2)")
    ap.add_argument("--eval-tokens", type=int, default=None, help="new tokens per prompt (default 128; tiny 8)")
    ap.add_argument("--gammas", type=int, nargs="+", default=None,
                    help="draft lengths scored (default 4; the first: the primary table)")
    ap.add_argument("--best-gamma", action="store_true",
                    help="name each arm's gamma with the highest measured speedup; without --gammas scores "
                         f"{', '.join(str(g) for g in BEST_GAMMA_CANDIDATES)} (4 first)")
    ap.add_argument("--eval-batch-size", type=int, default=1,
                    help="the evaluator's batch size (default 1; speedups compare only at 1, where the best gamma "
                         "is picked)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0], help="sampling temperatures scored")
    ap.add_argument("--peer-validator-prompts", type=int, default=None,
                    help="score ModelOpt's heads with its own validator on this many of the evaluator's prompts (at "
                         "most --eval-prompts; default all of them; 0: not run). It decodes without a KV cache: "
                         "minutes per arm at the default prompts and tokens")
    ap.add_argument("--curve-prompts", type=int, default=None,
                    help="prompts scoring each epoch-end head for the learning curves (default 16; tiny 2; 0: none)")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a vLLM venv (scripts/engine_test.sh makes .venv-vllm): serve one head per trainer")
    ap.add_argument("--ours-variant", nargs="+", action="append", default=None, metavar="OVERRIDE",
                    help="one more specdistill arm: recipe=eagle3_serve with these Hydra overrides (e.g. "
                         "trainer.optimizer=muon, or objective.steps=7 objective.decay=0.8), on the same store, "
                         "scored and paired like every arm: a peer's choice measured in our trainer. Repeatable")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arm-timeout", type=float, default=None, help="kill a peer arm after this many seconds")
    ap.add_argument("--skip-install", action="store_true", help="use the peer venvs as they are")
    a = ap.parse_args(argv)
    if a.eval_batch_size < 1:
        ap.error("--eval-batch-size must be at least 1")
    if a.peer_validator_prompts is not None and a.peer_validator_prompts < 0:
        ap.error("--peer-validator-prompts must be at least 0")
    a.gammas = scored_gammas(a.gammas, a.best_gamma)
    a.epochs = a.epochs or (1 if a.tiny else 6)
    a.prompts = a.prompts or (16 if a.tiny else 800)
    a.eval_prompts = a.eval_prompts or (2 if a.tiny else 80)
    a.eval_tokens = a.eval_tokens or (8 if a.tiny else 128)
    a.curve_prompts = (2 if a.tiny else 16) if a.curve_prompts is None else a.curve_prompts
    a.peer_validator_prompts = a.eval_prompts if a.peer_validator_prompts is None else a.peer_validator_prompts
    out = (a.out or REPO / "outputs" / ("peers-tiny" if a.tiny else "peers")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([sys.executable, "-m", "benchmarks.peers.run", *(argv if argv is not None else sys.argv[1:])])
    t_start = time.perf_counter()

    if not a.skip_install:
        for peer in a.peers:
            install.install(peer)
    if a.tiny:
        target = str(make_tiny_target(out / "tiny_target"))
        shape = tiny_shape(Path(target))
    else:
        from specdistill.assets import resolve_model_path

        target, shape = resolve_model_path("embedded:smollm2-135m-instruct"), HeadShape()

    ours = train_ours(a, target, shape, out)
    pdata = write_peer_data(a, ours, target, out, a.peers)
    budget = f"{a.wall_seconds:g} s of training per peer arm" if a.wall_seconds else f"{a.epochs} epoch(s) per arm"
    settings = [setting_key(t, g) for t in a.temperatures for g in a.gammas]
    results = {"mode": "tiny" if a.tiny else "SmolLM2-135M-Instruct", "command": command, "budget": budget,
               "settings": settings, "eval_batch_size": a.eval_batch_size, "wall_seconds": a.wall_seconds,
               "target": target, "shape": asdict(shape), "rows": pdata["rows"], "loss_tokens": pdata["loss_tokens"],
               "store": ours["store"], "arms": {}}
    results["arms"]["specdistill"] = {**ours, "record": {"settings": asdict(arms.OURS)},
                                      "loss_tokens_per_s": per_second(ours)}
    for overrides in a.ours_variant or []:
        name = variant_name(overrides)
        rec = train_ours(a, target, shape, out, name=name, variant=tuple(overrides))
        if rec["store"] != ours["store"]:
            raise SystemExit(f"{name} trained on another store ({rec['store']}, not {ours['store']}): its overrides "
                             "changed the data; a variant may change the training only")
        results["arms"][name] = {**rec, "record": {"settings": asdict(arms.OURS), "overrides": list(overrides)},
                                 "loss_tokens_per_s": per_second(rec)}
    import torch
    from transformers import AutoModelForCausalLM

    target_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    validator_ids = []
    if a.peer_validator_prompts and set(a.peers) & set(VALIDATED_PEERS):
        from specdistill.decoding.kv import max_positions
        from specdistill.models.target import load_tokenizer

        validator_ids = validator_prompt_ids(load_tokenizer(target), a.peer_validator_prompts, a.eval_prompts,
                                             a.eval_tokens, max_positions(target_model))
    for peer in a.peers:
        for kind in a.arms:
            name = f"{peer}-{kind}"
            rec = train_peer(a, peer, kind, shape, target, pdata, out, validator_ids)
            rec["record"] = arms.arm_record(peer, kind, shape)
            if rec.get("rc") == 0:
                rec["loss_tokens_per_s"] = per_second(rec)
                try:
                    rec["conversion"] = convert_peer(peer, rec, target, target_model, pdata["first_row"])
                except Exception as e:  # named in the report, the other arms go on
                    rec["error"] = f"conversion: {type(e).__name__}: {e}"
                    log(f"{name}: {rec['error']}")
            results["arms"][name] = rec
            write_report(out, results)
    results["paired"] = {}
    for t in a.temperatures:
        for g in a.gammas:
            key = setting_key(t, g)
            for name, rec in results["arms"].items():
                export = arm_export(name, rec)
                if export:
                    rec.setdefault("evals", {})[key] = evaluate(a, name, export, target, out, t, g)
                    log(f"{name} at {key}: tau {rec['evals'][key].get('tau')}")
                write_report(out, results)
            try:
                results["paired"][key] = paired(results, key)
            except Exception as e:  # the unpaired table stands
                log(f"paired comparison at {key} not made: {type(e).__name__}: {e}")
            write_report(out, results)
            if a.vllm_python and key == results["settings"][0]:  # the engine's figure before the other settings
                serve_in_vllm(a, results, target, out)
                write_report(out, results)
    if a.best_gamma or len(a.gammas) > 1:
        results["best_gamma"] = pick_best_gammas(results, a.temperatures, a.gammas, a.eval_batch_size)
        write_report(out, results)
    if a.curve_prompts:
        learning_curves(a, results, target, target_model, out)
        try:
            plot_curves(out, results)
        except Exception as e:  # the curves stay in results.json
            log(f"curve plot not written: {e}")
    results["total_s"] = time.perf_counter() - t_start
    write_report(out, results)
    log(f"done in {results['total_s']:.0f} s: {out / 'results.md'}")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
