"""Read conversation rows from any source and normalise them to OpenAI-style messages, counting malformed rows."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from specdistill.assets import EMBEDDED_DATA, EMBEDDED_PREFIX, is_embedded

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "assistant": "assistant", "system": "system"}
FORMATS = ("auto", "sharegpt", "messages", "prompt")
REPLACEMENT = "\ufffd"  # what a byte that is not valid UTF-8 becomes when read with errors="replace"


class MalformedRow(ValueError):
    """A row that cannot become a conversation; its message is the reason reported to the user."""


@dataclass
class UnreadableLine:
    """A line of a .jsonl file that is not a JSON object: kept in place of its row so that it is counted, reported
    with its line number and skipped like any other malformed row."""
    line: int  # 1-based line number in the file
    error: str


class Rows(list):
    """Rows read from a file, with the 1-based line number of each (JSON lines) for error reports."""
    lines: Optional[list[int]] = None


MAX_REPORTED = 10  # malformed rows listed one by one (line, reason) in the data report


@dataclass
class Conversations:
    conversations: list[list[dict]]  # each: [{"role": ..., "content": ...}, ...]
    num_rows: int
    malformed: Counter = field(default_factory=Counter)  # reason -> count
    repaired: int = 0  # rows kept after dropping leading assistant turns
    indices: list[int] = field(default_factory=list)  # source row index of each kept conversation
    examples: dict = field(default_factory=dict)  # reason -> first row index with it
    malformed_rows: list = field(default_factory=list)  # the first MAX_REPORTED: {"row", "line"?, "reason"}
    replacement_chars: int = 0  # U+FFFD in the kept conversations (invalid UTF-8 bytes read with errors="replace")
    rows_with_replacement: int = 0  # kept conversations holding at least one

    def report(self) -> dict:
        return {"rows": self.num_rows, "kept": len(self.conversations), "repaired_leading_assistant": self.repaired,
                "replacement_characters": self.replacement_chars,
                "rows_with_replacement_characters": self.rows_with_replacement,
                "malformed": dict(self.malformed),
                "first_malformed_row": self.examples,
                "malformed_rows": self.malformed_rows}


def load_rows(path: str, split: str = "train", max_rows: Optional[int] = None, keep_bad: bool = False) -> list[dict]:
    """Rows as dicts from embedded:<name>, a local json/jsonl/parquet file, or a hub dataset (datasets).
    A JSON-lines line that does not parse raises ValueError naming it, or with keep_bad=True becomes an
    UnreadableLine row (normalize counts and reports it)."""
    if is_embedded(path):
        name = path[len(EMBEDDED_PREFIX):]
        if name not in EMBEDDED_DATA:
            raise ValueError(f"unknown embedded dataset {name!r}; known: {sorted(EMBEDDED_DATA)}")
        return EMBEDDED_DATA[name](max_rows)
    import datasets

    from specdistill.paths import looks_local

    p = Path(path).expanduser()
    if p.exists():
        kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(p.suffix)
        if kind is None:
            raise ValueError(f"data file {p} must be .json, .jsonl or .parquet")
        if p.is_file() and _blank(p):
            raise ValueError(f"data file {p} is empty: it holds no rows. Each row must be a JSON object with "
                             "`conversations` (ShareGPT), `messages` (OpenAI) or `prompt`")
        if p.suffix == ".jsonl":  # line by line: one bad line is one malformed row, not a refused file
            return _read_jsonl(p, max_rows, keep_bad)
        try:
            ds = datasets.load_dataset(kind, data_files=str(p), split="train")
        except Exception as e:  # pyarrow's JSON errors are not user-friendly: say what is wrong and where
            if kind == "json":  # a .json file of JSON lines: read it line by line too
                return _read_jsonl(p, max_rows, keep_bad)
            raise ValueError(f"could not read {p} as {kind}: {type(e).__name__}: {str(e)[:300]}. Each row must be a "
                             "JSON object with `conversations` (ShareGPT), `messages` (OpenAI) or `prompt`") from None
    elif looks_local(path):
        raise FileNotFoundError(f"data file {path!r} does not exist ({p.resolve()}); a local-looking path is never "
                                "looked up on the Hub")
    else:
        ds = datasets.load_dataset(path, split=split)
    if max_rows is not None:
        ds = ds.select(range(min(max_rows, len(ds))))
    return ds.to_list()


def _blank(p: Path) -> bool:
    with p.open("rb") as f:
        head = f.read(4096)
    return not head.strip() and p.stat().st_size <= 4096


def _read_jsonl(p: Path, max_rows: Optional[int], keep_bad: bool) -> Rows:
    import json

    rows, lines = Rows(), []
    # utf-8-sig: a byte order mark some editors write at the start is dropped, not read as part of the first row
    with p.open(encoding="utf-8-sig", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if max_rows is not None and len(rows) >= max_rows:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if not keep_bad:
                    raise ValueError(f"{p}, line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
                row = UnreadableLine(n, f"invalid JSON ({e.msg})")
            rows.append(row)
            lines.append(n)
    if not rows:
        raise ValueError(f"data file {p} holds no rows (only blank lines)")
    rows.lines = lines
    return rows


def detect_format(row: dict) -> str:
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "messages"
    if "prompt" in row:
        return "prompt"
    raise MalformedRow("no conversations/messages/prompt field")


def to_messages(row: dict, fmt: str = "auto") -> list[dict]:
    """One row -> [{"role", "content"}]. Raises MalformedRow with the reason."""
    if not isinstance(row, dict):
        raise MalformedRow("row is not an object")
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt == "prompt":
        prompt = row.get("prompt")
        if isinstance(prompt, list):  # a prompt given as messages
            return _check_messages(prompt, need_assistant=False)
        if not isinstance(prompt, str) or not prompt.strip():
            raise MalformedRow("empty or non-string prompt")
        msgs = [{"role": "user", "content": prompt}]
        if isinstance(row.get("completion"), str) and row["completion"]:
            msgs.append({"role": "assistant", "content": row["completion"]})
        return msgs
    if fmt == "sharegpt":
        turns = row.get("conversations")
        if not isinstance(turns, list):
            raise MalformedRow("conversations is not a list")
        msgs = []
        for t in turns:
            if not isinstance(t, dict) or "from" not in t or "value" not in t:
                raise MalformedRow("turn without from/value")
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise MalformedRow(f"unknown speaker {t['from']!r}")
            msgs.append({"role": role, "content": t["value"]})
        return _check_messages(msgs)
    if fmt == "messages":
        return _check_messages(row.get("messages"))
    raise ValueError(f"unknown data.format {fmt!r}; choose one of {FORMATS}")


def _check_messages(msgs, need_assistant: bool = True) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise MalformedRow("empty conversation")
    out = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise MalformedRow("message without a system/user/assistant role")
        if not isinstance(m.get("content"), str):
            raise MalformedRow("message content is not a string")
        if not m["content"].strip():
            raise MalformedRow("empty message")
        out.append({"role": m["role"], "content": m["content"]})
    # ShareGPT splits long chats, so many rows open with the assistant continuing: drop those leading turns
    # (counted by `normalize` as a repair, not as malformed).
    system = [m for m in out if m["role"] == "system"][:1]
    body = [m for m in out if m["role"] != "system"]
    while body and body[0]["role"] == "assistant":
        body = body[1:]
    out = system + body
    if not body or body[0]["role"] != "user":
        raise MalformedRow("conversation does not start with a user turn")
    if any(a["role"] == b["role"] for a, b in zip(body, body[1:])):
        raise MalformedRow("user/assistant turns do not alternate")
    if need_assistant and not any(m["role"] == "assistant" for m in body):
        raise MalformedRow("no assistant turn")
    return out


def normalize(rows: Iterable[dict], fmt: str = "auto", need_assistant: bool = True) -> Conversations:
    convs, kept, bad, first, listed = [], [], Counter(), {}, []
    n = repaired = 0
    lines = getattr(rows, "lines", None)
    for i, row in enumerate(rows):
        n += 1
        try:
            if isinstance(row, UnreadableLine):
                raise MalformedRow("invalid JSON")
            msgs = to_messages(row, fmt)
            raw = row.get("conversations") or row.get("messages") or []
            first_raw = raw[0] if isinstance(raw, list) and raw else {}
            role = first_raw.get("from", first_raw.get("role")) if isinstance(first_raw, dict) else None
            if role is not None and SHAREGPT_ROLES.get(str(role).lower()) == "assistant":
                repaired += 1
            if need_assistant and not any(m["role"] == "assistant" for m in msgs):
                raise MalformedRow("no assistant turn")
            convs.append(msgs)
            kept.append(i)
        except MalformedRow as e:
            bad[str(e)] += 1
            first.setdefault(str(e), i)
            if len(listed) < MAX_REPORTED:
                entry = {"row": i, "reason": row.error if isinstance(row, UnreadableLine) else str(e)}
                if lines is not None:
                    entry["line"] = lines[i]
                listed.append(entry)
    per_row = [sum(str(m.get("content", "")).count(REPLACEMENT) for m in msgs) for msgs in convs]
    return Conversations(convs, n, malformed=bad, examples=first, repaired=repaired,
                         indices=kept, malformed_rows=listed, replacement_chars=sum(per_row),
                         rows_with_replacement=sum(1 for k in per_row if k))
