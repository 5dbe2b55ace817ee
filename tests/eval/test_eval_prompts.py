"""Prompt sets: the embedded MT-bench and held-out ShareGPT sets, local files of any row shape, and clear errors."""
import json

import pytest

from specdistill.data.chat import prompt_ids
from specdistill.data.prompts import PromptError, first_turn, load_prompt_messages, load_prompts


def test_mt_bench_is_the_80_first_turns():
    msgs = load_prompt_messages("embedded:mt_bench")[0]
    assert len(msgs) == 80
    assert all(len(m) == 1 and m[0]["role"] == "user" and m[0]["content"].strip() for _, m in msgs)
    assert [i for i, _ in msgs] == list(range(80))


def test_sharegpt_heldout_takes_first_user_turns_from_the_end():
    msgs, skipped = load_prompt_messages("embedded:sharegpt", 5)
    idx = [i for i, _ in msgs]
    assert len(msgs) == 5 and idx == sorted(idx, reverse=True) and idx[0] > 17000  # the tail: not in training
    assert all(m[-1]["role"] == "user" and m[-1]["content"].strip() for _, m in msgs)


def test_local_file_rows_of_every_shape(tmp_path, tok):
    rows = [{"prompt": "tell me about the cat"},
            {"messages": [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three"},
                          {"role": "user", "content": "four"}]},
            {"conversations": [{"from": "gpt", "value": "leading"}, {"from": "human", "value": "hello the dog"},
                               {"from": "gpt", "value": "hi"}]},
            {"turns": ["what is red", "and blue"]}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    ps = load_prompts(str(path), tok, num_prompts=None, max_new_tokens=8, context=512)
    assert [p.messages for p in ps.prompts] == [
        [{"role": "user", "content": "tell me about the cat"}], [{"role": "user", "content": "one two"}],
        [{"role": "user", "content": "hello the dog"}], [{"role": "user", "content": "what is red"}]]
    assert ps.ids[0] == prompt_ids(tok, [{"role": "user", "content": "tell me about the cat"}])
    assert tok.decode(ps.ids[0]).endswith("<|im_start|>assistant\n")  # chat template with the generation prompt
    assert len(load_prompts(str(path), tok, num_prompts=2, max_new_tokens=8).prompts) == 2


def test_bad_prompts_get_clear_errors(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "  "}) + "\n")
    with pytest.raises(PromptError, match="prompt row 1 is empty"):
        load_prompts(str(path), tok, num_prompts=None, max_new_tokens=8)
    with pytest.raises(PromptError, match="none of the fields"):
        first_turn({"text": "x"}, 3)
    with pytest.raises(PromptError, match="no user turn"):
        first_turn({"messages": [{"role": "assistant", "content": "x"}]})
    with pytest.raises(PromptError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"), tok, num_prompts=None, max_new_tokens=8)
    with pytest.raises(PromptError, match="only inside training"):
        load_prompts("heldout", tok, num_prompts=2, max_new_tokens=8)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "the cat " * 100}))
    with pytest.raises(PromptError, match="exceeds the target's context of 64 tokens"):
        load_prompts(str(long), tok, num_prompts=None, max_new_tokens=8, context=64)
    with pytest.raises(PromptError, match="no prompt .* is left"):  # skipping every prompt is an error too
        load_prompts(str(long), tok, num_prompts=None, max_new_tokens=8, max_prompt_tokens=16)
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"prompt": "the cat " * 100}) + "\n" + json.dumps({"prompt": "hi"}))
    ps = load_prompts(str(both), tok, num_prompts=None, max_new_tokens=8, context=64, max_prompt_tokens=32)
    assert len(ps) == 1 and ps.skipped_too_long == 1 and ps.prompts[0].source_index == 1
