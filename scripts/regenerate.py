"""Regenerate the assistant turns of a conversation set with the target model (batched, resumable).

Drafts trained on the target's own answers accept more than drafts trained on someone else's (EAGLE-3, SpecForge).
Each assistant turn is replaced by the target's response to the conversation so far (with earlier turns already
regenerated). Decoding uses specdistill.spec.target_generate, the evaluator's KV-cached batched decoder.

  python scripts/regenerate.py --data embedded:sharegpt --max-rows 2000 --out data/sharegpt_smollm2.jsonl
  python scripts/train.py recipe=eagle3 data=jsonl data.path=data/sharegpt_smollm2.jsonl

The output is JSONL of {"id", "messages"}; rows are appended as batches finish, so an interrupted run resumes where it
stopped (ids already in the file are skipped; a torn last line is dropped).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def done_ids(out: Path) -> set[str]:
    """Ids already written; a torn last line (crash mid-write) is cut off so appends stay valid JSONL."""
    if not out.exists():
        return set()
    ids, good_bytes = set(), 0
    with out.open("rb") as f:
        for line in f:
            try:
                ids.add(str(json.loads(line)["id"]))
                good_bytes += len(line)
            except (json.JSONDecodeError, KeyError):
                break
    if good_bytes != out.stat().st_size:
        with out.open("r+b") as f:
            f.truncate(good_bytes)
    return ids


def regenerate_batch(model, tokenizer, convs: list[list[dict]], max_new_tokens: int, temperature: float,
                     max_context: int, generator=None) -> list[list[dict]]:
    """Replace every assistant turn of each conversation, turn by turn, batching rows at the same turn index."""
    import torch

    from specdistill.data.chat import prompt_ids
    from specdistill.spec import target_generate

    out: list[list[dict]] = [[] for _ in convs]
    user_turns = [[i for i, m in enumerate(c) if m["role"] == "user"] for c in convs]
    for turn in range(max(len(u) for u in user_turns)):
        rows, prompts = [], []
        for r, c in enumerate(convs):
            if turn >= len(user_turns[r]):
                continue
            i = user_turns[r][turn]
            prev = user_turns[r][turn - 1] + 1 if turn else 0
            out[r].extend(m for m in c[prev:i + 1] if m["role"] != "assistant")  # system / user turns as given
            ids = prompt_ids(tokenizer, out[r])
            if len(ids) + max_new_tokens > max_context:
                continue  # this row stops here: its context is full
            rows.append(r), prompts.append(ids)
        if not rows:
            break
        L = max(len(p) for p in prompts)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        input_ids = torch.full((len(prompts), L), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for b, p in enumerate(prompts):  # left padding
            input_ids[b, L - len(p):] = torch.tensor(p)
            mask[b, L - len(p):] = 1
        dev = next(model.parameters()).device
        roll = target_generate(model, input_ids.to(dev), mask.to(dev), max_new_tokens=max_new_tokens,
                               temperature=temperature, eos_token_id=tokenizer.eos_token_id, generator=generator)
        for b, r in enumerate(rows):
            toks = [t for t in roll.tokens(b) if t != tokenizer.eos_token_id]
            out[r].append({"role": "assistant", "content": tokenizer.decode(toks, skip_special_tokens=True).strip()})
    # a row whose context filled up ends on a user turn: drop that dangling turn
    return [c if c and c[-1]["role"] == "assistant" else c[:-1] for c in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--data", default="embedded:sharegpt")
    ap.add_argument("--format", default="auto")
    ap.add_argument("--max-rows", type=int, default=1000)
    ap.add_argument("--max-turns", type=int, default=2, help="user turns kept per conversation")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=768, help="longer first prompts are skipped")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: physical cores)")
    args = ap.parse_args()

    import torch

    from specdistill.threads import configure_threads

    configure_threads(args.threads, "--threads")
    from tqdm.auto import tqdm

    from specdistill.data.chat import prompt_ids
    from specdistill.data.conversations import load_rows, normalize
    from specdistill.models.target import load_causal_lm, load_tokenizer
    from specdistill.spec.kv import max_positions

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_causal_lm(args.target, args.dtype).to(device).eval()
    tok = load_tokenizer(args.target)
    rows = load_rows(args.data, max_rows=args.max_rows)
    convs = normalize(rows, args.format)
    if convs.malformed:
        print(f"[regenerate] {sum(convs.malformed.values())} malformed rows skipped: {dict(convs.malformed)}")
    kept_ids = [str(rows[i].get("id", i)) for i in convs.indices]
    todo = []
    skipped_long = 0
    for cid, msgs in zip(kept_ids, convs.conversations):
        users = [j for j, m in enumerate(msgs) if m["role"] == "user"]
        msgs = msgs[: users[args.max_turns] if len(users) > args.max_turns else len(msgs)]
        if len(prompt_ids(tok, msgs[: users[0] + 1])) > args.max_prompt_tokens:
            skipped_long += 1
            continue
        todo.append((cid, msgs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    finished = done_ids(out)
    todo = [(cid, m) for cid, m in todo if cid not in finished]
    print(f"[regenerate] {len(finished)} already done, {len(todo)} to go, {skipped_long} skipped (prompt > "
          f"{args.max_prompt_tokens} tokens); writing {out}")
    gen = torch.Generator(device=device).manual_seed(args.seed) if args.temperature > 0 else None
    ctx = max_positions(model) or 4096
    with out.open("a") as f, tqdm(total=len(todo), desc="regenerate", unit="conv") as bar:
        for s in range(0, len(todo), args.batch_size):
            chunk = todo[s: s + args.batch_size]
            new = regenerate_batch(model, tok, [m for _, m in chunk], args.max_new_tokens, args.temperature, ctx, gen)
            for (cid, _), msgs in zip(chunk, new):
                if any(m["role"] == "assistant" for m in msgs):
                    f.write(json.dumps({"id": cid, "messages": msgs}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(chunk))


if __name__ == "__main__":
    main()
