"""Pipeline stage: regenerate the training answers with the target and keep its features (data/regenerated.py).

With data.regenerate.engine=hf it decodes with the shared decoder (decoding.target_generate), capturing the features
while decoding; with another answer engine (pipeline/engines.py: vLLM) the engine writes the answers and one prefill
per part recaptures their features. It writes the store that data/regenerated.py reads and sits above both, so the
data package never imports decoding. data.regenerate.shard=i/n makes a process write only the parts p % n == i.
Before writing it says how large the parts can get (and refuses them when the disk cannot hold that much); each part
records its answer and feature-recapture seconds in the store (pipeline/telemetry.py).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

from specdistill.config import Config, RegenerateConfig
from specdistill.data.regenerated import (RegeneratedStore, write_part, drop_damaged_parts, num_parts, part_path,
                                          part_problem, split_rows, store_inputs, store_key)
from specdistill.pipeline.engines import AnswerEngine, Sampling
from specdistill.pipeline.telemetry import PartTiming, read_parts, record_part, stage_timing
from specdistill.tensors import pad_rows
from specdistill.tokens import pad_id
from specdistill.ranks import WorkShare, alone


def load_prompt_rows(cfg: RegenerateConfig, tokenizer, count: int,
                     log: Callable[[str], None] = print) -> tuple[list[list[int]], dict]:
    """Token ids of the first `count` usable first user turns (fewer if the source runs out), and what was skipped
    and why. The order depends only on the source and the filters, so a longer list extends a shorter one."""
    from specdistill.data.chat import prompt_ids
    from specdistill.data.conversations import REPLACEMENT, load_rows
    from specdistill.data.prompts import PromptError, first_turn

    rows = load_rows(cfg.prompts)
    ids, skipped, seen, replaced = [], {"no usable user turn": 0, "too long": 0, "duplicate": 0}, set(), 0
    for i, row in enumerate(rows):
        if len(ids) >= count:
            break
        try:
            msgs = first_turn(row, i)
        except PromptError:
            skipped["no usable user turn"] += 1
            continue
        p = prompt_ids(tokenizer, msgs)
        if len(p) > cfg.max_prompt_tokens:
            skipped["too long"] += 1
            continue
        if tuple(p) in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(tuple(p))
        ids.append(p)
        replaced += sum(str(m.get("content", "")).count(REPLACEMENT) for m in msgs)
    if not ids:
        raise ValueError(f"data.regenerate.prompts={cfg.prompts!r} gave no usable prompt (skipped: {skipped}); raise "
                         "data.regenerate.max_prompt_tokens or use another source")
    if replaced:
        log(f"[regenerate] {replaced} replacement characters (U+FFFD: bytes that were not valid UTF-8, or already in "
            f"the text) in the kept prompts of {cfg.prompts}: they are answered as they are. Fix the file's encoding "
            "to regenerate from the real text")
    return ids, skipped


def answers_donor(store_dir: Path, inputs: dict) -> Optional[Path]:
    """A store holding the very answers a store of `inputs` would decode, with other layers' features, or None.

    Which layers are captured does not change what the target emits, so a store whose folder name is store_key of
    these inputs with its own layers has the same ids part by part (decoding is keyed by part index and seed); of
    several, the one with the most parts."""
    best, best_parts = None, 0
    for s in sorted(Path(store_dir).glob("*/settings.json")):
        other = json.loads(s.read_text()).get("layers")
        same_answers = s.parent.name == store_key({**inputs, "layers": other}) if other else False
        if not same_answers or list(other) == list(inputs["layers"]):
            continue
        n = len(list(s.parent.glob("part-*.safetensors")))
        if n > best_parts:
            best, best_parts = s.parent, n
    return best


def regeneration_batch_size(cfg: RegenerateConfig, model) -> int:
    """cfg.batch_size, or (null) the batch the target's device decodes well: 16 on CPU, where a larger batch gains
    little; on CUDA rows_that_fit in the device's total memory.

    Total memory, not free memory: the batch size fixes which prompts share a part and is part of the store's key, so
    every process of a launch and every run on the same kind of GPU must pick the same number."""
    if cfg.batch_size is not None:
        return int(cfg.batch_size)
    param = next(model.parameters())
    if param.device.type != "cuda":
        return 16
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.cuda.get_device_properties(param.device).total_memory
    return rows_that_fit(model.config, cfg, param.element_size(), weights, total)


def rows_that_fit(config, cfg: RegenerateConfig, elem_bytes: int, weight_bytes: int, device_bytes: int) -> int:
    """The largest power of two up to 256 whose KV cache, prefill hidden states and activations and captured features
    take at most half of the device memory beside the weights (the other half: allocator slack, logits, the rest)."""
    c = config
    T = cfg.max_prompt_tokens + cfg.max_new_tokens
    L, H = c.num_hidden_layers, c.hidden_size
    head_dim = getattr(c, "head_dim", None) or H // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_row = (2 * L * kv_heads * head_dim * T * elem_bytes  # KV cache
               + (L + 1) * cfg.max_prompt_tokens * H * elem_bytes  # every hidden state of the prefill
               + 4 * cfg.max_prompt_tokens * getattr(c, "intermediate_size", 4 * H) * elem_bytes  # prefill MLP
               + 4 * T * H * 4)  # captured features (aux + final) in fp32
    budget = (device_bytes - weight_bytes) // 2
    size = 1
    while size < 256 and 2 * size * per_row <= budget:
        size *= 2
    return size


def parse_shard(shard: Optional[str]) -> tuple[int, int]:
    """data.regenerate.shard "i/n" -> (i, n) with 0 <= i < n; null -> (0, 1), every part."""
    if shard is None:
        return 0, 1
    try:
        i, n = (int(x) for x in str(shard).split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"data.regenerate.shard={shard!r} must be 'i/n' with 0 <= i < n (shard 0/4 of 4 machines "
                         "writes parts 0, 4, 8, ...), or null for every part")
    return i, n


def shard_parts(parts: list[int], shard: Optional[str]) -> list[int]:
    """The parts of `parts` that shard "i/n" writes: p % n == i."""
    i, n = parse_shard(shard)
    return [p for p in parts if p % n == i]


def recapture_part(target_model, src: Path, layers: list[int], aux_width: int, pad: int) -> list[dict]:
    """The rows of part `src` with the features of `layers`, from one prefill of its stored ids (no decoding)."""
    from safetensors.torch import load_file

    t = load_file(str(src))
    rows = list(torch.split(t["ids"], t["lengths"].tolist()))
    return recapture_rows(target_model, rows, t["prompt_lengths"].tolist(), layers, aux_width, pad)


@torch.no_grad()
def recapture_rows(target_model, rows: list[torch.Tensor], plens: list[int], layers: list[int], aux_width: int,
                   pad: int) -> list[dict]:
    """Store rows {ids, aux, final, prompt_length} for `rows` (each (T,): prompt then answer ids; plens: prompt
    lengths) with the features of `layers`, from one prefill.

    Rows are right-padded (positions 0..T-1, as when decoding); the last token of a row gets zeros (a decoded row has
    zeros there too, or, when it ended before the rest of its batch, the features of its fed EOS; nothing reads them).
    Only the last position's logits are computed (logits_to_keep=1): the features are hidden states, and full logits
    of a batch would cost B x T x V floats."""
    device = next(target_model.parameters()).device
    input_ids, mask = pad_rows(rows, pad, side="right", device=device)
    out = target_model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True, use_cache=False,
                       logits_to_keep=1)
    hidden = torch.cat([out.hidden_states[k] for k in layers], dim=-1).float().cpu()  # (B, T, A+H)
    result = []
    for b, (ids, p) in enumerate(zip(rows, plens)):
        feats = hidden[b, :len(ids)].clone()  # (T, A+H)
        feats[-1] = 0
        result.append({"ids": ids, "aux": feats[:, :aux_width], "final": feats[:, aux_width:], "prompt_length": p})
    return result


def regenerate_store(cfg: RegenerateConfig, target_model, tokenizer, target_path: str, aux_layer_ids: list[int],
                     log: Callable[[str], None] = print, progress: bool = True,
                     share: Callable[[Path], WorkShare] = alone, cache=None,
                     engine: Optional[AnswerEngine] = None) -> tuple[Path, int]:
    """Make, finish or reuse the parts this run needs; returns (store folder, parts to read).

    share(folder) says how the processes of a launch split the parts of that folder (ranks.folder_share:
    every process of the launch when they all see the folder, the processes of each node when it is node-local); each
    decodes the missing parts it owns, then all wait until the store is complete. Every process makes the same calls
    whatever it finds on disk, so the collective steps never mismatch.

    A part that a store of the same answers with other layers already has (another target.aux_layer_ids) is
    recaptured by one prefill of its ids (recapture_part) instead of decoded again: a forward over known tokens
    costs a fraction of generating them one by one. cache: the decoding's KV caches (decoding.CacheMode; None: growing),
    which never change the tokens, so the store's key ignores it.

    engine: what writes the answers of the parts to decode; None follows cfg.engine (hf: the decoder, capturing the
    features as it decodes; vllm: a VLLMEngine, made only when a part is missing). An engine's answers get their
    features by one prefill (recapture_rows). With cfg.shard "i/n" this process writes only the parts p % n == i, and
    the store is complete once every shard has run (it returns without waiting for the others)."""
    L = target_model.config.num_hidden_layers
    layers = list(aux_layer_ids) + [L]  # hidden_states[L]: after the final norm, what lm_head reads
    cfg = replace(cfg, batch_size=regeneration_batch_size(cfg, target_model))
    inputs = store_inputs(cfg, target_path, next(target_model.parameters()).dtype, layers, tokenizer)
    store_dir = Path(cfg.store_dir).expanduser()
    root = store_dir / store_key(inputs)
    root.mkdir(parents=True, exist_ok=True)
    drop_damaged_parts(root, log)  # header, size or SHA-256: named, then made again
    parse_shard(cfg.shard)  # a malformed shard is refused before any work
    if cfg.engine_args and cfg.engine != "vllm":
        raise ValueError(f"data.regenerate.engine_args={dict(cfg.engine_args)} are vLLM's: set "
                         "data.regenerate.engine=vllm, or data.regenerate.engine_args={} for our decoder")
    want = num_parts(cfg)
    complete = all(part_path(root, i).exists() for i in range(want))  # seen before any process of the launch writes
    work = share(root)
    if not complete:
        _write_settings(root, inputs)
        want = _fill(cfg, target_model, tokenizer, root, inputs, want, work, log, progress and work.index == 0,
                     cache, engine, target_path)
    else:
        log(f"[regenerate] reusing {want} parts of {root}")
    work.wait()  # every process: the store is complete once all have written their parts
    return root, want


def _write_settings(root: Path, inputs: dict) -> None:
    if (root / "settings.json").exists():
        return
    fd, tmp = tempfile.mkstemp(prefix="settings.json.", suffix=".tmp", dir=root)  # one temp name per process
    with os.fdopen(fd, "w") as f:
        json.dump(inputs, f, indent=1, default=str)
    os.replace(tmp, root / "settings.json")


def _say_why_not_reused(store_dir: Path, root: Path, inputs: dict, log: Callable[[str], None]) -> None:
    """A new store for a target that has others: name what differs from the closest one (an edited prompt file, new
    weights, other settings), so a regeneration nobody expected explains itself."""
    from specdistill.data.regenerated import input_differences

    best = None
    for f in store_dir.glob("*/settings.json"):
        if f.parent == root:
            continue
        try:
            other = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if other.get("target") == inputs["target"] and other.get("layers") == inputs["layers"]:
            diff = input_differences(other, inputs)
            if best is None or len(diff) < len(best[1]):
                best = (f.parent, diff)
    if best is not None:
        log(f"[regenerate] not reusing {best[0]}, made for this target with other inputs: {'; '.join(best[1])}")


def _fill(cfg: RegenerateConfig, target_model, tokenizer, root: Path, inputs: dict, want: int, work: WorkShare,
          log: Callable[[str], None], progress: bool, cache=None, engine: Optional[AnswerEngine] = None,
          target_path: str = "") -> int:
    """Write this process's share of the missing parts (recaptured from a donor store where one has their answers,
    else answered by the decoder or an engine); returns the number of parts the run reads (fewer than asked when the
    source runs out). Each part's timing goes to the store (pipeline/telemetry.py), and their sum to timing.json."""
    layers = inputs["layers"]
    prompts, skipped = load_prompt_rows(cfg, tokenizer, want * cfg.batch_size, log=log)
    batches = [prompts[s: s + cfg.batch_size] for s in range(0, len(prompts), cfg.batch_size)]
    want = len(batches)  # the source may run out
    missing = [i for i in range(want) if not part_path(root, i).exists()]
    log(f"[regenerate] {len(prompts)} prompts ({skipped} skipped) x <= {cfg.max_new_tokens} new tokens at "
        f"T={cfg.temperature}, batch {cfg.batch_size}, features of layers {layers} -> {root}; "
        f"{want - len(missing)} of {want} parts exist" + (f"; {work.count} processes share the rest" if work.count > 1
                                                           else ""))
    if len(missing) == want:
        _say_why_not_reused(Path(cfg.store_dir).expanduser(), root, inputs, log)
    if cfg.shard is not None:
        mine = shard_parts(missing, cfg.shard)
        log(f"[regenerate] shard {cfg.shard}: {len(mine)} of the {len(missing)} missing parts are this shard's")
        missing = mine
    missing = work.mine(missing)
    _check_size(cfg, root, [batches[i] for i in missing], len(layers) * target_model.config.hidden_size, log)
    pad = pad_id(tokenizer)
    A = (len(layers) - 1) * target_model.config.hidden_size
    donor = answers_donor(Path(cfg.store_dir).expanduser(), inputs)
    from_donor = [i for i in missing if donor is not None and part_path(donor, i).exists()
                  and part_problem(part_path(donor, i)) is None]  # a damaged donor part is decoded instead
    if from_donor:
        log(f"[regenerate] {len(from_donor)} of the {len(missing)} missing parts have their answers in {donor} "
            f"(layers {json.loads((donor / 'settings.json').read_text())['layers']}): recapturing their features by "
            "one prefill each, no decoding")
        _fill_from_donor(target_model, donor, root, from_donor, layers, A, pad, log, progress)
        done = set(from_donor)
        missing = [i for i in missing if i not in done]
    if missing and engine is not None:
        _fill_from_engine(cfg, engine, target_model, tokenizer, root, batches, missing, layers, A, log, progress)
    elif missing and cfg.engine == "vllm":
        from specdistill.assets import resolve_model_path
        from specdistill.pipeline.engines import VLLMEngine, engine_session

        make = partial(VLLMEngine, resolve_model_path(target_path), inputs["target_dtype"], dict(cfg.engine_args))
        with engine_session(make) as made:  # closed when the parts are written or on the way out
            log(f"[regenerate] vLLM engine started (its processes: {sorted(q.pid for q in made.processes)}); it is "
                "shut down when this run's parts are written")
            _fill_from_engine(cfg, made, target_model, tokenizer, root, batches, missing, layers, A, log, progress)
    elif missing:
        _fill_by_decoding(cfg, target_model, tokenizer, root, batches, missing, layers, A, log, progress, cache)
    if missing or from_donor:
        _log_summary(root, want, log, work.count)
    return want


def _check_size(cfg: RegenerateConfig, root: Path, batches: list[list[list[int]]], feature_width: int,
                log: Callable[[str], None]) -> None:
    """Say how large the parts to write can get, and refuse them when the disk cannot hold that much."""
    from specdistill.data.regenerated import FEATURE_DTYPE
    from specdistill.pipeline.telemetry import check_free_space, estimate_store_size, free_bytes, size_text

    if not batches:
        return
    size = estimate_store_size([len(p) for b in batches for p in b], len(batches), cfg.max_new_tokens, feature_width,
                               FEATURE_DTYPE.itemsize)
    free = free_bytes(root)
    log(f"[regenerate] the {size.parts} parts to write take up to {size_text(size.bytes)} ({size.rows} rows, <= "
        f"{size.tokens} tokens x {size.bytes_per_token} bytes); {size_text(free)} free in {root}")
    check_free_space(size, root, free, cfg.max_prompts, cfg.max_new_tokens)


def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="part", disable=not progress, dynamic_ncols=True)


def _done(root: Path, t: PartTiming, bar, t0: float, tokens: int) -> None:
    """A part is written: record its timing, log it above the bar (where the bar shows), advance the bar (this part's
    tokens/s and the run's so far)."""
    record_part(root, t)
    if not bar.disable:
        bar.write(f"[regenerate] {t.line()}")
    bar.update(1)
    rate = t.answer_tok_s if t.answer_s > 0 else t.recapture_tok_s
    bar.set_postfix(part_tok_s=f"{rate:.0f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")


def _fill_from_donor(target_model, donor: Path, root: Path, parts: list[int], layers: list[int], aux_width: int,
                     pad: int, log: Callable[[str], None], progress: bool) -> None:
    """Each part: the donor store's ids, their features for `layers` by one prefill."""
    t0, tokens = time.perf_counter(), 0
    bar = _bar(len(parts), "recapture", progress)
    for i in parts:
        s = time.perf_counter()
        rows = recapture_part(target_model, part_path(donor, i), layers, aux_width, pad)
        write_part(part_path(root, i), rows)
        plen = sum(r["prompt_length"] for r in rows)
        n = sum(len(r["ids"]) for r in rows)
        tokens += n
        _done(root, PartTiming(i, "donor", len(rows), plen, n - plen, 0.0, time.perf_counter() - s), bar, t0, tokens)
    bar.close()
    log(f"[regenerate] recaptured {len(parts)} parts: {tokens} tokens in {time.perf_counter() - t0:.0f} s")


# Decode steps between the host's checks for finished rows: the host queues steps ahead of the device (regeneration
# times parts, not steps; a part decodes at most this many - 1 steps past its last row's end).
DECODE_SYNC_EVERY = 8


def _fill_by_decoding(cfg: RegenerateConfig, target_model, tokenizer, root: Path, batches: list[list[list[int]]],
                      missing: list[int], layers: list[int], aux_width: int, log: Callable[[str], None],
                      progress: bool, cache) -> None:
    """Each part: our decoder answers its prompts and captures the features in the same forwards."""
    from specdistill.decoding import CacheMode, target_generate

    device = next(target_model.parameters()).device
    t0, new_tokens = time.perf_counter(), 0
    bar = _bar(len(missing), "regenerate", progress)
    for i in missing:
        s = time.perf_counter()
        chunk = batches[i]
        gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + i) if cfg.temperature > 0 else None
        input_ids, mask = pad_rows(chunk, pad_id(tokenizer), side="left")
        roll = target_generate(target_model, input_ids.to(device), mask.to(device), max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, eos_token_id=tokenizer.eos_token_id, generator=gen,
                               capture_layers=layers, cache=cache or CacheMode(), sync_every=DECODE_SYNC_EVERY)
        write_part(part_path(root, i), split_rows(chunk, roll.sequences.cpu(), roll.num_new_tokens.cpu(),
                                                   roll.hidden.float().cpu(), aux_width))
        n = int(roll.num_new_tokens.sum())
        new_tokens += n
        _done(root, PartTiming(i, "hf", len(chunk), sum(map(len, chunk)), n, time.perf_counter() - s, 0.0), bar, t0,
              new_tokens)
    bar.close()
    log(f"[regenerate] wrote {len(missing)} parts: {new_tokens} answer tokens in {time.perf_counter() - t0:.0f} s")


def _fill_from_engine(cfg: RegenerateConfig, engine: AnswerEngine, target_model, tokenizer, root: Path,
                      batches: list[list[list[int]]], missing: list[int], layers: list[int], aux_width: int,
                      log: Callable[[str], None], progress: bool) -> None:
    """Each missing part: the engine's answers to its prompts, their features by one prefill, written whole."""
    eos = tokenizer.eos_token_id
    stops = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    pad = pad_id(tokenizer)
    name = getattr(engine, "name", type(engine).__name__)
    t0, new_tokens, answer_s, recapture_s = time.perf_counter(), 0, 0.0, 0.0
    bar = _bar(len(missing), f"regenerate ({name})", progress)
    for i in missing:
        chunk = batches[i]
        sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.seed * 1_000_003 + i, stops)
        s = time.perf_counter()
        answers = engine.answers(chunk, sampling)
        a_s = time.perf_counter() - s
        bad = [b for b, a in enumerate(answers) if not 1 <= len(a) <= cfg.max_new_tokens]
        if len(answers) != len(chunk) or bad:
            raise ValueError(f"answer engine {name} gave {len(answers)} answers to {len(chunk)} "
                             f"prompts of part {i}, rows {bad[:5]} outside 1..max_new_tokens={cfg.max_new_tokens} "
                             "tokens: data.regenerate.engine=hf decodes with specdistill's own decoder")
        s = time.perf_counter()
        rows = [torch.tensor(p + list(a), dtype=torch.long) for p, a in zip(chunk, answers)]
        write_part(part_path(root, i), recapture_rows(target_model, rows, [len(p) for p in chunk], layers, aux_width,
                                                       pad))
        r_s = time.perf_counter() - s
        n = sum(len(a) for a in answers)
        new_tokens, answer_s, recapture_s = new_tokens + n, answer_s + a_s, recapture_s + r_s
        _done(root, PartTiming(i, name, len(chunk), sum(map(len, chunk)), n, a_s, r_s), bar, t0, new_tokens)
    bar.close()
    log(f"[regenerate] wrote {len(missing)} parts through {name}: {new_tokens} answer tokens in {answer_s:.0f} s "
        f"({new_tokens / max(answer_s, 1e-9):.0f} tok/s), features by prefill in {recapture_s:.0f} s")


def _log_summary(root: Path, parts: int, log: Callable[[str], None], processes: int) -> None:
    """timing.json from every part's record so far (other processes' and shards' too), and one line per stage."""
    from specdistill.pipeline.telemetry import write_summary

    for engine, st in write_summary(root, parts)["stages"].items():
        answers = ("answers from a store of other layers" if engine == "donor" else
                   f"answers {st['answer_s']:.0f} s ({st['answer_tok_s']} tok/s)")
        features = (f"features by prefill {st['recapture_s']:.0f} s ({st['recapture_tok_s']} tok/s)"
                    if st["recapture_s"] else "features captured while decoding")
        log(f"[regenerate] {engine}: {st['parts']} parts, {st['answer_tokens']} answer tokens; {answers}, {features}"
            + (" (every process so far)" if processes > 1 else "") + f"; {root / 'timing.json'}")


def check_fits_positions(cfg: RegenerateConfig, model) -> None:
    """A prompt of max_prompt_tokens and its max_new_tokens answer must fit the target's positions; refused naming
    both settings before any prompt is answered."""
    from specdistill.decoding.kv import max_positions

    limit = max_positions(model)
    need = cfg.max_prompt_tokens + cfg.max_new_tokens
    if limit is not None and need > limit:
        raise ValueError(f"data.regenerate.max_prompt_tokens={cfg.max_prompt_tokens} + data.regenerate.max_new_tokens="
                         f"{cfg.max_new_tokens} = {need} tokens, more than the target's {limit} positions "
                         f"(max_position_embeddings). Fix: lower them so their sum is at most {limit}")


def build_regenerated_data(cfg: Config, target, tokenizer, log=print, share: Callable[[Path], WorkShare] = alone):
    """data.regenerate.enabled: the TokenizedData of a (cached) regenerated store. `cfg` is the whole run config;
    `target` the models.target.Target, whose aux_layer_ids are the head's; share as in regenerate_store. The last
    data.heldout_size rows are held out (plain ids, no features: the held-out proxy runs the target itself)."""
    import datasets

    from specdistill.data.dataset import TokenizedData
    from specdistill.drafts.eagle3.model import default_aux_layer_ids

    rcfg = cfg.data.regenerate
    check_fits_positions(rcfg, target.model)
    L = target.config.num_hidden_layers
    aux = list(target.aux_layer_ids or default_aux_layer_ids(L))
    from specdistill.decoding import CacheMode

    cache = CacheMode(static=cfg.eval.static_cache, compile=cfg.eval.compile)  # the run's decoding (eval.*)
    root, parts = regenerate_store(rcfg, target.model, tokenizer, str(cfg.target.path), aux, log=log, share=share,
                                   cache=cache)
    if rcfg.shard is not None:  # a shard run writes its parts and ends; the run that trains has no shard
        have = sum(part_path(root, i).exists() for i in range(parts))
        log(f"[regenerate] shard {rcfg.shard} is done: {root} has {have} of {parts} parts. Once every shard has run, "
            "train with data.regenerate.shard=null: it reuses the whole store")
        raise SystemExit(0)
    store = RegeneratedStore(root, parts)
    n_held = min(cfg.data.heldout_size, max(1, len(store) // 10)) if cfg.data.heldout_size > 0 else 0
    train = store.subset(list(range(len(store) - n_held)))
    held_rows = [store[i] for i in range(len(store) - n_held, len(store))]
    held = datasets.Dataset.from_dict({"input_ids": [r["input_ids"] for r in held_rows],
                                       "loss_mask": [r["loss_mask"] for r in held_rows]})
    held_msgs: list = []  # the held-out rows are ids; eval.prompts=heldout has no messages here
    report = store.report()
    report.update({"source": f"regenerated:{root}", "train_examples": len(train), "heldout_examples": len(held),
                   "train_loss_tokens": train.answer_tokens, "train_tokens": train.total_tokens,
                   # answer and feature-recapture seconds per engine, summed over the parts' records (telemetry.py)
                   "regeneration_stages": stage_timing(read_parts(root, parts))})
    return TokenizedData(train, held, held_msgs, report, root.name)
