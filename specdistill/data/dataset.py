"""Build the tokenized train / held-out datasets (cached on disk), with optional packing."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from specdistill.assets import source_digest
from specdistill.config import DataConfig
from specdistill.files import named_writes, verify_folder, write_manifest
from specdistill.data.chat import tokenize_conversation
from specdistill.data.conversations import load_rows, normalize


@dataclass
class TokenizedData:
    train: "datasets.Dataset"  # noqa: F821  columns input_ids, loss_mask
    heldout: "datasets.Dataset"  # noqa: F821
    heldout_messages: list  # the held-out conversations, for prompt-based evaluation
    report: dict  # rows read, malformed counts by reason, tokens
    fingerprint: str = ""  # identifies source + tokenizer + settings (offline features are checked against it)


def _source_id(path: str) -> str:
    """The source by content (its bytes' digest: an edited file is another cache entry), a hub dataset by name."""
    return source_digest(path)


def _fingerprint(cfg: DataConfig, tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())[:: max(1, len(tokenizer) // 2000)])
    key = json.dumps({"src": _source_id(cfg.path), "cfg": {k: v for k, v in asdict(cfg).items()
                                                           if k not in ("cache_dir", "num_proc", "offline_dir")},
                      "template": tokenizer.chat_template, "vocab": vocab, "v": 3}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def build_data(cfg: DataConfig, tokenizer, log=print) -> TokenizedData:
    import datasets

    cache = Path(cfg.cache_dir).expanduser() / _fingerprint(cfg, tokenizer)
    if (cache / "report.json").exists():
        cached = _read_cache(cache, log)
        if cached is not None:
            return cached

    rows = load_rows(cfg.path, cfg.split, cfg.max_rows, keep_bad=True)
    convs = normalize(rows, cfg.format)
    report = convs.report()
    if convs.replacement_chars:
        log(f"[data] {convs.replacement_chars} replacement characters (U+FFFD: bytes that were not valid UTF-8, or "
            f"already in the text) in {convs.rows_with_replacement} conversations of {cfg.path}; they are trained on "
            "as they are (counted in data_report.json). Fix the file's encoding to train on the real text")
    if convs.num_rows == 0:
        raise ValueError(f"data.path={cfg.path!r} holds no rows (split {cfg.split!r}): point data.path at a file or "
                         "dataset of conversations")
    bad = sum(convs.malformed.values())
    if bad:
        reasons = ", ".join(f"{n} {r}" for r, n in convs.malformed.most_common())
        where = ", ".join(f"line {m['line']}" if "line" in m else f"row {m['row']}" for m in convs.malformed_rows)
        log(f"[data] {bad} of {convs.num_rows} rows are malformed and skipped ({reasons}); first ones: {where} "
            "(listed in data_report.json)")
    if not convs.conversations or bad > cfg.max_malformed_fraction * max(1, convs.num_rows):
        raise ValueError(f"{bad} of {convs.num_rows} rows in {cfg.path} are malformed ({dict(convs.malformed)}), more "
                         f"than data.max_malformed_fraction={cfg.max_malformed_fraction}. Check data.format (auto | "
                         "sharegpt | messages | prompt) and the first malformed rows: "
                         f"{convs.malformed_rows}")

    conversations = list(convs.conversations)
    random.Random(cfg.seed).shuffle(conversations)
    n_held = min(cfg.heldout_size, max(1, len(conversations) // 10)) if cfg.heldout_size > 0 else 0
    held_msgs, train_msgs = conversations[:n_held], conversations[n_held:]
    if not train_msgs:
        raise ValueError(f"only {len(conversations)} usable conversations: nothing left to train on after holding "
                         f"out {n_held}; lower data.heldout_size or add data")

    def tok(batch):
        out = {"input_ids": [], "loss_mask": []}
        for m in batch["messages"]:
            t = tokenize_conversation(tokenizer, m, cfg.max_length)
            out["input_ids"].append(t.input_ids)
            out["loss_mask"].append(t.loss_mask)
        return out

    def to_ds(msgs):
        ds = datasets.Dataset.from_dict({"messages": msgs})
        ds = ds.map(tok, batched=True, remove_columns=["messages"], num_proc=cfg.num_proc if len(msgs) > 256 else None,
                    desc="tokenize")
        before = len(ds)
        ds = ds.filter(lambda r: sum(r["loss_mask"]) > 0, desc="drop rows with no assistant token")
        return ds, before - len(ds)

    train, dropped_train = to_ds(train_msgs)
    held, dropped_held = to_ds(held_msgs) if held_msgs else (train.select([]), 0)
    if dropped_train:
        log(f"[data] {dropped_train} conversations have no assistant token within max_length={cfg.max_length}: skipped")
    if cfg.packing:
        train = pack(train, cfg.max_length)
    if len(train) == 0:
        raise ValueError(f"no training example has an assistant token within data.max_length={cfg.max_length}")
    report.update({"train_examples": len(train), "heldout_examples": len(held),
                   "no_assistant_token_within_max_length": dropped_train + dropped_held,
                   "train_loss_tokens": int(sum(sum(m) for m in train["loss_mask"])),
                   "train_tokens": int(sum(len(x) for x in train["input_ids"]))})

    # Written to a temp folder and renamed: a crash mid-write never leaves a cache that looks complete. The manifest
    # (sizes and SHA-256) lets a later run name a truncated or damaged file and rebuild the cache.
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        with named_writes(cache.parent, "data.cache_dir", "nothing was cached; the next run tokenizes the data again"):
            tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
            train.save_to_disk(str(tmp / "train"))
            held.save_to_disk(str(tmp / "heldout"))
            (tmp / "heldout_messages.json").write_text(json.dumps(held_msgs))
            (tmp / "report.json").write_text(json.dumps(report, indent=1))
            write_manifest(tmp)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, cache)
    except OSError:  # another rank got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenizedData(datasets.load_from_disk(str(cache / "train")), datasets.load_from_disk(str(cache / "heldout")),
                         held_msgs, report, cache.name)


def positions_error(length: int, limit: Optional[int], what: str, fix: str) -> Optional[str]:
    """The one rule for a sequence against the target's positions: `length` tokens must fit its
    max_position_embeddings `limit` (None: the model has no limit). Past it the target's positions (and so its logits
    and features) are undefined, in training as in decoding. The message names `what` and the `fix`."""
    if limit is None or length <= limit:
        return None
    return f"{what} has {length} tokens, more than the target's max_position_embeddings={limit}: {fix}"


def check_rows_fit(data: TokenizedData, limit: Optional[int], max_length: int) -> None:
    """Refuse training rows longer than the target's positions (`limit`), as the evaluator refuses a prompt whose
    answer would pass them, naming how many and data.max_length, which cuts every row."""
    if limit is None:
        return
    lengths = [len(ids) for split in (data.train, data.heldout) for ids in split["input_ids"]]
    over = [n for n in lengths if n > limit]
    if over:
        error = positions_error(max(over), limit, f"the longest of {len(over)} training rows (of {len(lengths)})",
                                f"set data.max_length={limit} or lower (rows are cut to it; now {max_length})")
        raise ValueError(error)


def _read_cache(cache: Path, log) -> Optional[TokenizedData]:
    """The tokenized data cached at `cache`, or None when a file there is damaged (truncated, unreadable, not what was
    written): the bad files are named, the folder moved aside and the caller rebuilds it."""
    import datasets

    problems = verify_folder(cache)
    if not problems:
        try:
            data = TokenizedData(datasets.load_from_disk(str(cache / "train")),
                                 datasets.load_from_disk(str(cache / "heldout")),
                                 json.loads((cache / "heldout_messages.json").read_text()),
                                 json.loads((cache / "report.json").read_text()), cache.name)
            log(f"[data] cached tokenized data at {cache}")
            return data
        except Exception as e:  # pyarrow, json and OS errors alike: a cache is rebuilt, never trusted half-read
            problems = [f"{cache}: unreadable ({type(e).__name__}: {str(e)[:300]})"]
    aside = cache.with_name(f"{cache.name}.damaged")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(cache, aside)
    log(f"[data] the cached tokenized data is damaged and will be rebuilt (moved aside to {aside}):\n  - "
        + "\n  - ".join(problems))
    return None


def pack(ds, max_length: int):
    """Concatenate examples into rows of max_length (greedy, in order). Attention crosses document boundaries
    ("naive packing"); target and draft see the same context, so KD targets stay consistent."""
    ids, mask, out_ids, out_mask = [], [], [], []
    for r in ds:
        ids.extend(r["input_ids"])
        mask.extend(r["loss_mask"])
        while len(ids) >= max_length:
            out_ids.append(ids[:max_length]), out_mask.append(mask[:max_length])
            ids, mask = ids[max_length:], mask[max_length:]
    if ids:
        out_ids.append(ids), out_mask.append(mask)
    import datasets

    return datasets.Dataset.from_dict({"input_ids": out_ids, "loss_mask": out_mask})
