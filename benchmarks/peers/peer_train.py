"""Train one EAGLE-3 head with a peer's own code, inside that peer's venv (benchmarks/peers/install.py).

    <peer venv>/bin/python benchmarks/peers/peer_train.py <spec.json>

The spec (written by benchmarks/peers/run.py) names the peer, the arm's settings (arms.py), the data the writers made,
the target folder, the output folder, the epochs and an optional training wall-time budget (wall_seconds, counted
from the start of training). It writes <out>/head (the head
as the peer saves it) and <out>/train_report.json (wall time, optimizer steps, peak RSS, the loss curve when the
peer's loop is driven here). Only the standard library, torch and the peer are imported: no specdistill.
speculators runs its own trainer (speculators.train.cli.main); SpecForge and ModelOpt have no trainer usable offline
on one CPU process, so their model, loss, data reader and (SpecForge) optimizer run in the short loop below.
A ModelOpt spec with a "validate" block ({prompt_ids, gamma, max_new_tokens}) also scores the trained head with
ModelOpt's own validator (HFARValidation.validate_online) after training: <out>/validate.json (write_validation).
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Callable


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    frac = (step - warmup) / max(1, total - warmup)
    return max(0.0, 1.0 - frac) if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def target_tensor(target: str, names: tuple[str, ...]):
    """The first of `names` found in the target's safetensors files (lm_head, or the embeddings when tied)."""
    from safetensors import safe_open

    for f in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for n in names:
                if n in h.keys():
                    return h.get_tensor(n)
    raise KeyError(f"none of {names} in {target}")


class Points:
    """The head saved at each epoch end, for the learning curves: {epoch, dir, train_s, loss_tokens}. Saving is
    timed apart, so train_s and the arm's wall_s count training only."""

    def __init__(self, out: Path):
        self.root, self.rows, self.paused = Path(out) / "epochs", [], 0.0

    def save(self, epoch: int, t0: float, loss_tokens: int, write) -> None:
        start = time.perf_counter()
        folder = self.root / str(epoch)
        write(folder)
        self.rows.append({"epoch": epoch, "dir": str(folder), "train_s": start - t0 - self.paused,
                          "loss_tokens": loss_tokens})
        self.paused += time.perf_counter() - start

    def wall(self, t0: float) -> float:
        return time.perf_counter() - t0 - self.paused


# ---------------------------------------------------------------------------------------------------- speculators
def epoch_steps(n_rows: int, per_step: int, steps_per_epoch: int, spec: dict, rng: random.Random):
    """(epoch, its steps' row indices) for spec["epochs"] epochs, rows shuffled by rng each epoch; no step starts once
    spec["wall_seconds"] (if set) have passed. Consume each epoch's steps before asking for the next epoch."""
    deadline = time.time() + spec["wall_seconds"] if spec.get("wall_seconds") else None

    def late() -> bool:
        return deadline is not None and time.time() > deadline

    for epoch in range(spec["epochs"]):
        if late():
            return
        order = list(range(n_rows))
        rng.shuffle(order)
        yield epoch, (order[b * per_step:(b + 1) * per_step] for b in range(steps_per_epoch) if not late())


def speculators_argv(spec: dict) -> list[str]:
    """`speculators train` flags for an arm: its settings, our data, aux ids and vocabulary, the CPU flags."""
    s, d, out = spec["settings"], spec["data"], Path(spec["out"])
    ckpt = out / "ckpt"
    argv = ["--verifier-name-or-path", spec["target"], "--data-path", d["root"], "--save-path", str(ckpt),
            "--epochs", str(spec["epochs"]), "--lr", str(s["lr"]), "--optimizer", s["optimizer"],
            "--weight-decay", str(s["weight_decay"]), "--ttt-steps", str(s["ttt_steps"]),
            "--ttt-step-loss-decay", str(s["step_decay"]), "--draft-vocab-size", str(spec["draft_vocab_size"]),
            "--d2t-path", d["d2t_path"], "--t2d-path", d["t2d_path"], "--target-layer-ids",
            *[str(k) for k in spec["peer_aux_ids"]], "--num-layers", "1", "--draft-arch", "llama",
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
            "--total-seq-len", str(spec["tokens_per_step"]), "--train-data-ratio", str(d["train_data_ratio"]),
            "--num-workers", "0", "--no-resume-from-checkpoint", "--log-dir", str(out / "logs"),
            "--seed", str(spec["seed"]), "--scheduler-type", {"constant": "none"}.get(s["schedule"], s["schedule"]),
            "--loss-fn", "kl_div"]
    if s["warmup_steps"]:
        argv += ["--scheduler-warmup-steps", str(s["warmup_steps"])]
    norms = s["norms"]
    argv.append("--norm-before-residual" if norms.get("norm_before_residual", True) else "--no-norm-before-residual")
    argv.append("--norm-before-fc" if norms.get("norm_before_fc", True) else "--no-norm-before-fc")
    argv.append("--norm-output" if norms.get("norm_output", True) else "--no-norm-output")
    if spec["arm"] != "defaults":
        argv += ["--full-attention-indices", "0"]
    return argv


def train_speculators(spec: dict) -> dict:
    from shims import speculators as shim

    shim.apply(spec.get("wall_seconds"))
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    out = Path(spec["out"])
    ckpt = out / "ckpt"
    argv = speculators_argv(spec)
    print("[peers/speculators] speculators train " + " ".join(argv), flush=True)
    t0, wall0 = time.perf_counter(), time.time()
    main(TrainConfig.resolve(argv))
    wall = time.perf_counter() - t0
    epochs = sorted((p for p in ckpt.iterdir() if p.name.isdigit() and (p / "model.safetensors").exists()),
                    key=lambda p: int(p.name))
    if not epochs:
        raise RuntimeError(f"speculators saved no checkpoint under {ckpt}")
    shutil.copytree(epochs[-1], out / "head", dirs_exist_ok=True)
    # its own checkpoint per epoch, at the training time and loss tokens the shim saw when it was saved (validation
    # and saving left out; an epoch cut short by the wall budget counts only the batches trained on)
    points = [{"epoch": int(p.name) + 1, "dir": str(p),
               "train_s": shim.EPOCH_TRAIN_S.get(int(p.name), (p / "model.safetensors").stat().st_mtime - wall0),
               "loss_tokens": shim.EPOCH_LOSS_TOKENS[int(p.name)]} for p in epochs]
    return {"wall_s": shim.TIMES["run_training"] or wall, "process_s": wall, "timings": dict(shim.TIMES),
            "epochs_saved": len(epochs), "points": points, "loss_tokens": points[-1]["loss_tokens"],
            "command": "speculators train " + " ".join(argv)}


# ------------------------------------------------------------------------------------------------------ specforge
def train_specforge(spec: dict) -> dict:
    from shims import specforge as shim

    shim.apply()
    import torch
    from transformers import LlamaConfig

    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding

    s, d, out = spec["settings"], spec["data"], Path(spec["out"])
    tcfg = json.loads((Path(spec["target"]) / "config.json").read_text())
    shape = spec["shape"]
    dcfg = {**tcfg, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
            "intermediate_size": shape["intermediate_size"], "num_attention_heads": shape["num_attention_heads"],
            "num_key_value_heads": shape["num_key_value_heads"], "draft_vocab_size": spec["draft_vocab_size"],
            "target_hidden_size": tcfg["hidden_size"], "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": spec["peer_aux_ids"]}}
    torch.manual_seed(spec["seed"])
    draft = LlamaForCausalLMEagle3(LlamaConfig(**dcfg), attention_backend="sdpa").float()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target_tensor(spec["target"], ("model.embed_tokens.weight",)))
    draft.freeze_embedding()
    draft.load_vocab_mapping(d["vocab_map"])
    model = OnlineEagle3Model(draft, length=s["ttt_steps"], attention_backend="sdpa")
    lm_head = target_tensor(spec["target"], ("lm_head.weight", "model.embed_tokens.weight")).float()  # (V, H)
    files = sorted(str(p) for p in Path(d["features"]).glob("*.ckpt"))
    per_step = s["rows_per_step"]
    steps_per_epoch = -(-len(files) // per_step)  # every row once per epoch (equal loss tokens): a short last batch
    total = steps_per_epoch * spec["epochs"]
    warmup_ratio = s["norms"].get("warmup_ratio", min(s["warmup_steps"], total - 1) / total)  # its scheduler
    warmup_ratio = min(warmup_ratio, (total - 1) / total)  # refuses warmup_steps >= total_steps
    opt = BF16Optimizer(draft, lr=s["lr"], weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"] or 1e9,
                        total_steps=total, warmup_ratio=warmup_ratio,
                        lr_scheduler="cosine" if s["schedule"] == "cosine" else "constant")
    for g in opt.optimizer.param_groups:
        g["betas"] = tuple(s["betas"])
    collate = DataCollatorWithPadding()
    rng = random.Random(spec["seed"])
    curve, step, tokens, points, t0 = [], 0, 0, Points(out), time.perf_counter()
    for epoch, steps in epoch_steps(len(files), per_step, steps_per_epoch, spec, rng):
        for rows_at in steps:
            rows = [normalize_offline_sample(torch.load(files[i], weights_only=True), spec["max_len"])
                    for i in rows_at]
            batch = collate(rows)
            tokens += int(batch["loss_mask"].sum())
            target = padding(batch["target"].float() @ lm_head.T, left=False)  # (B, T, V): position t+1's logits
            input_ids = padding(batch["input_ids"], left=False)
            plosses, *_ = model(input_ids=input_ids, attention_mask=batch["attention_mask"],
                                loss_mask=batch["loss_mask"][..., None], target=target,
                                hidden_states=batch["hidden_state"].float())
            loss = sum(s["step_decay"] ** i * p for i, p in enumerate(plosses))
            loss.backward()
            opt.step()
            draft.zero_grad(set_to_none=True)
            step += 1
            curve.append([points.wall(t0), step, float(loss.detach())])
        points.save(epoch + 1, t0, tokens, draft.save_pretrained)
    wall = points.wall(t0)
    draft.save_pretrained(out / "head")
    return {"wall_s": wall, "steps": step, "curve": curve, "points": points.rows, "loss_tokens": tokens}


# ------------------------------------------------------------------------------------------------------- modelopt
def train_modelopt(spec: dict) -> dict:
    from shims import modelopt as shim

    import torch
    from transformers import AutoModelForCausalLM

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel

    s, d, out = spec["settings"], spec["data"], Path(spec["out"])
    tcfg = json.loads((Path(spec["target"]) / "config.json").read_text())
    shape = spec["shape"]
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32)
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg.update(shim.config_overrides())
    cfg.update(eagle_ttt_steps=s["ttt_steps"], eagle_loss_decay_factor=s["step_decay"])
    rope = dict(tcfg.get("rope_parameters") or {"rope_type": "default",
                                                 "rope_theta": tcfg.get("rope_theta", 10000.0)})
    heads = shape["num_attention_heads"]
    cfg["eagle_architecture_config"].update(
        head_dim=tcfg.get("head_dim") or tcfg["hidden_size"] // tcfg["num_attention_heads"],
        num_attention_heads=heads, num_key_value_heads=shape["num_key_value_heads"],
        intermediate_size=shape["intermediate_size"], rms_norm_eps=tcfg["rms_norm_eps"], rope_scaling=rope,
        rope_theta=rope.get("rope_theta"), max_position_embeddings=tcfg["max_position_embeddings"],
        draft_vocab_size=spec["draft_vocab_size"], eagle_aux_hidden_state_layer_ids=spec["peer_aux_ids"],
        torch_dtype="float32", **{k: v for k, v in s["norms"].items()})
    eagle_cfg = copy.deepcopy(cfg)  # the config as given, for the validator's online twin
    mtsp.convert(model, [("eagle", cfg)])
    HFEagleModel.load_draft_vocab_cache(model, d["d2t_path"])
    model.float().train()
    params = [p for n, p in model.named_parameters() if p.requires_grad and "eagle_module" in n]
    opt = torch.optim.AdamW(params, lr=s["lr"], betas=tuple(s["betas"]), weight_decay=s["weight_decay"])
    files = sorted(str(p) for p in Path(d["dump"]).glob("*.pt"))
    ds = OfflineSupervisedDataset(files, answer_only_loss=True)
    # one training length for every batch, as its recipes set training_seq_len: its TTT attention masks are cached
    # by shape, so batches padded to different lengths fail in attention
    collate = EagleOfflineDataCollator(train_len=spec["max_len"])
    per_step = s["rows_per_step"]
    steps_per_epoch = -(-len(files) // per_step)  # every row once per epoch (equal loss tokens): a short last batch
    total = steps_per_epoch * spec["epochs"]
    rng = random.Random(spec["seed"])
    arch = dict(cfg["eagle_architecture_config"])
    arch.update(vocab_size=tcfg["vocab_size"])

    def save_head(folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items() if k.startswith("eagle_module.")},
                  str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(arch, indent=1, default=str))

    curve, step, tokens, points, t0 = [], 0, 0, Points(out), time.perf_counter()
    for epoch, steps in epoch_steps(len(files), per_step, steps_per_epoch, spec, rng):
        for rows_at in steps:
            items = [ds[i] for i in rows_at]
            batch = collate(items)
            tokens += int(batch["loss_mask"].sum())
            batch["base_model_outputs"] = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
                                           for k, v in batch["base_model_outputs"].items()}
            for g in opt.param_groups:
                g["lr"] = s["lr"] * lr_factor(step, total, s["warmup_steps"], s["schedule"])
            out_ = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         loss_mask=batch["loss_mask"], labels=batch["labels"],
                         base_model_outputs=batch["base_model_outputs"])
            out_.loss.backward()
            if s["max_grad_norm"]:
                torch.nn.utils.clip_grad_norm_(params, s["max_grad_norm"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            curve.append([points.wall(t0), step, float(out_.loss.detach())])
        points.save(epoch + 1, t0, tokens, save_head)
    wall = points.wall(t0)
    save_head(out / "head")
    return {"wall_s": wall, "steps": step, "curve": curve, "points": points.rows, "loss_tokens": tokens,
            "_model": model, "_eagle_cfg": eagle_cfg}


# ModelOpt's own validator on the trained head: its target forward, its EAGLE forward (the first layer's
# input_layernorm included, which the served layout drops), its acceptance metric.
MODELOPT_VALIDATOR = "modelopt HFARValidation.validate_online"
NO_POOLED_AR = ("validate_online returns one ratio per prompt (1 + accepted drafts, summed over its rounds, over the "
                "rounds) and keeps both counts inside, so prompts cannot be pooled by rounds: mean_ar is the mean of "
                "the per-prompt ratios")


def summarise_ar(per_prompt_ar: list[float], validate: dict) -> dict:
    """validate.json's body for the per-prompt ARs of one validator run; ValueError when no prompt was scored or an
    AR is not finite."""
    ars = [float(x) for x in per_prompt_ar]
    if not ars:
        raise ValueError("the validator scored no prompt")
    bad = [x for x in ars if not math.isfinite(x)]
    if bad:
        raise ValueError(f"non-finite AR from the validator: {bad[:3]}")
    return {"validator": MODELOPT_VALIDATOR, "gamma": validate["gamma"], "max_new_tokens": validate["max_new_tokens"],
            "prompts": len(ars), "per_prompt_ar": ars, "mean_ar": sum(ars) / len(ars), "note": NO_POOLED_AR}


def write_validation(out: Path, validate: dict, score: Callable[[], list[float]]) -> dict:
    """Run score() (the per-prompt ARs) and write <out>/validate.json: summarise_ar's record, or the validator,
    gamma, max_new_tokens and the error when score() or the summary raises, so the arm's training results stand.
    Both carry `seconds`, the validator's wall time."""
    t0 = time.perf_counter()
    try:
        rec = summarise_ar(score(), validate)
    except Exception as e:  # named in the report beside the arm's other results
        rec = {"validator": MODELOPT_VALIDATOR, "gamma": validate.get("gamma"),
               "max_new_tokens": validate.get("max_new_tokens"), "error": f"{type(e).__name__}: {e}"}
    rec["seconds"] = time.perf_counter() - t0
    (Path(out) / "validate.json").write_text(json.dumps(rec, indent=1))
    return rec


def modelopt_validator_ars(spec: dict, trained, eagle_cfg: dict) -> list[float]:
    """ModelOpt's HFARValidation.validate_online on each spec["validate"] prompt: greedy speculative decoding with the
    target's forward and ModelOpt's EAGLE forward, `gamma` chained drafts a round, `max_new_tokens` tokens (no stop at
    EOS), batch 1, no KV cache; one AR per prompt. The trained model holds no decoder layers (eagle_offline drops
    them), so the validator runs a second HFEagleModel, converted online from the target with the same config and
    given the trained eagle_module's weights."""
    from shims import modelopt as shim

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.plugins.hf_eagle import HFARValidation

    v = spec["validate"]
    cfg = copy.deepcopy(eagle_cfg)
    cfg.update(shim.validation_overrides())
    model = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32)
    mtsp.convert(model, [("eagle", cfg)])
    loaded = model.eagle_module.load_state_dict(trained.eagle_module.state_dict(), strict=False)
    # the RoPE module is made on the first forward and holds no saved tensors: the only names allowed to differ
    stray = [k for k in (*loaded.missing_keys, *loaded.unexpected_keys) if not k.startswith("rotary_emb.")]
    if stray:
        raise RuntimeError(f"the trained eagle_module does not load into the validator's model: {stray[:6]}")
    model.float().eval()
    validator = HFARValidation(model, shim.validation_tokenizer(AutoTokenizer.from_pretrained(spec["target"])))
    ars = []
    with torch.no_grad():
        for i, ids in enumerate(v["prompt_ids"]):
            _, ar = validator.validate_online(v["max_new_tokens"], input_ids=torch.tensor([ids], dtype=torch.long),
                                              steps=v["gamma"])
            ars.append(float(ar))
            print(f"[peers/modelopt] {spec['arm']}: its validator, prompt {i + 1}/{len(v['prompt_ids'])}: AR "
                  f"{ars[-1]:.3f}", flush=True)
    return ars


TRAINERS = {"speculators": train_speculators, "specforge": train_specforge, "modelopt": train_modelopt}


# -------------------------------------------------------------------------------------------------------- probes
# The trained head's step-0 predictions on one row through the PEER's own forward, so the driver can check that the
# converted head (specdistill's forward on the same row) predicts the same tokens. A probe is a list of draft-vocabulary
# argmaxes for slots t = 0 .. T-2: slot t reads aux(t) and token t+1 and predicts token t+2.
def probe_speculators(spec: dict, ids, aux) -> list[int]:
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    head = Path(spec["out"]) / "head"
    config = Eagle3SpeculatorConfig.from_pretrained(head)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(head, config=config, verifier=spec["target"]).float().eval()
    T = len(ids)
    with torch.no_grad():  # its shift_batch: slot s holds token s+1 and features of s, positions from 1
        tokens = model(hidden_states=aux[None, :-1].float(), input_ids=ids[None, 1:],
                       document_ids=torch.zeros(1, T - 1, dtype=torch.long),
                       position_ids=torch.arange(1, T)[None], ttt_steps=1)
    return tokens[0][0].tolist()


def probe_specforge(spec: dict, ids, aux) -> list[int]:
    import torch
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    from safetensors.torch import load_file
    from transformers import LlamaConfig

    head = Path(spec["out"]) / "head"
    # built and loaded by hand: from_pretrained leaves the RoPE buffer of its attention uninitialised (NaN logits)
    model = LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(head), attention_backend="sdpa").float()
    model.load_state_dict(load_file(str(head / "model.safetensors")))
    T = len(ids)
    with torch.no_grad():  # the calls its training step makes (OnlineEagle3Model, step 0); its forward() gives NaN
        embeds = model.embed_input_ids(torch.cat([ids[1:], ids[:1]])[None])  # slot t reads token t+1
        hs = model.project_hidden_states(aux[None].float())
        mask = model.prepare_decoder_attention_mask(attention_mask=torch.ones(1, T, dtype=torch.long),
                                                    hidden_states=hs, batch_size=1, seq_length=T,
                                                    past_key_values_length=0)
        h = model.backbone(input_embeds=embeds, hidden_states=hs, cache_hidden=[[], []], attention_mask=mask,
                           position_ids=torch.arange(T)[None], past_key_values=None, use_cache=True)
        return model.compute_logits(h)[0, :-1].argmax(-1).tolist()


def probe_modelopt(spec: dict, ids, aux, model) -> list[int]:
    import torch

    captured = {}
    original = model._eagle_forward

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.setdefault("logits", out[2])
        return out

    model._eagle_forward = capture
    model.eval()
    T = len(ids)
    with torch.no_grad():
        model(input_ids=ids[None], attention_mask=torch.ones(1, T, dtype=torch.long),
              base_model_outputs={"base_model_hidden_states": torch.zeros(1, T, aux.shape[-1] // 3),
                                  "aux_hidden_states": aux[None].float(),
                                  "base_model_logits": torch.zeros(1, T, model.config.vocab_size)})
    model._eagle_forward = original
    return captured["logits"][0, :-1].argmax(-1).tolist()


def probe_row(spec: dict):
    """The first training row in the peer's own data files: (ids (T,), aux (T, 3H))."""
    import torch

    d = spec["data"]
    if spec["peer"] == "speculators":
        from safetensors.torch import load_file

        hs = load_file(str(Path(d["root"]) / "hidden_states" / "hs_0.safetensors"))["hidden_states"]
        ids = load_file(str(Path(d["root"]) / "hidden_states" / "hs_0.safetensors"))["token_ids"]
        return ids, hs[:, :-1].flatten(1)
    if spec["peer"] == "specforge":
        row = torch.load(sorted(Path(d["features"]).glob("*.ckpt"))[0], weights_only=True)
        return row["input_ids"], row["aux_hidden_state"][0]
    row = torch.load(sorted(Path(d["dump"]).glob("*.pt"))[0], weights_only=True)
    return row["input_ids"], row["aux_hidden_states"]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", spec.get("threads", 1))))
    report = TRAINERS[spec["peer"]](spec)
    model = report.pop("_model", None)
    eagle_cfg = report.pop("_eagle_cfg", None)
    try:
        ids, aux = probe_row(spec)
        argmax = (probe_modelopt(spec, ids, aux, model) if spec["peer"] == "modelopt"
                  else {"speculators": probe_speculators, "specforge": probe_specforge}[spec["peer"]](spec, ids, aux))
        (out / "probe.json").write_text(json.dumps({"row": 0, "draft_argmax": argmax}))
    except Exception as e:  # the arm stands; the driver reports the probe as missing, with this reason
        (out / "probe.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    report.update(peak_rss_mb=peak_rss_mb(), peer=spec["peer"], arm=spec["arm"])
    (out / "train_report.json").write_text(json.dumps(report, indent=1))
    print(f"[peers/{spec['peer']}] {spec['arm']}: trained in {report['wall_s']:.1f} s -> {out / 'head'}", flush=True)
    if spec["peer"] == "modelopt" and spec.get("validate"):
        rec = write_validation(out, spec["validate"], lambda: modelopt_validator_ars(spec, model, eagle_cfg))
        print(f"[peers/modelopt] {spec['arm']}: its validator: "
              + (f"mean AR {rec['mean_ar']:.4f} over {rec['prompts']} prompts" if "mean_ar" in rec else rec["error"])
              + f" ({rec['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
