"""Conversations, the assistant-only mask and its shift, malformed rows, packing, and the step-addressed loader."""
import json

import pytest

from specdistill.config import DataConfig
from specdistill.data.chat import collate, tokenize_conversation
from specdistill.data.conversations import normalize, to_messages, MalformedRow
from specdistill.data.dataset import build_data, pack
from specdistill.data.loader import StepBatches
from tests.conftest import conversations, make_tokenizer

MSGS = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello what is two"},
        {"role": "assistant", "content": "two is a number"}, {"role": "user", "content": "why"},
        {"role": "assistant", "content": "the cat sat"}]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_mask_covers_exactly_the_assistant_turns_and_is_shifted(tok):
    t = tokenize_conversation(tok, MSGS, max_length=512)
    assert len(t.input_ids) == len(t.loss_mask)
    # the tokens the loss predicts (t+1 where mask[t]) decode to the assistant turns and their end markers
    predicted = [t.input_ids[i + 1] for i in range(len(t.input_ids) - 1) if t.loss_mask[i]]
    assert tok.decode(predicted) == "two is a number<|im_end|>\nthe cat sat<|im_end|>\n"
    assert t.loss_mask[-1] == 0  # the last position predicts nothing
    # unshifted, the mask would start on the first assistant token itself: check we did shift by exactly one
    first = t.loss_mask.index(1)
    assert tok.decode([t.input_ids[first]]).endswith("\n")  # the header's newline predicts the first answer token


def test_truncation_keeps_ids_and_mask_aligned(tok):
    full = tokenize_conversation(tok, MSGS, max_length=512)
    cut = tokenize_conversation(tok, MSGS, max_length=20)
    assert cut.input_ids == full.input_ids[:20]
    assert cut.loss_mask[:19] == full.loss_mask[:19] and cut.loss_mask[19] == 0


def test_formats_are_normalised():
    sg = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    oa = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    pr = {"prompt": "hi", "completion": "yo"}
    assert to_messages(sg) == to_messages(oa) == to_messages(pr)
    # ShareGPT rows that open with the assistant (split chats) are repaired, not dropped
    split = {"conversations": [{"from": "gpt", "value": "cont"}] + sg["conversations"]}
    assert to_messages(split) == to_messages(sg)


def test_malformed_rows_are_counted_with_reasons():
    rows = conversations(10) + [{"conversations": []}, {"foo": 1}, {"messages": [{"role": "user", "content": "x"},
                                {"role": "user", "content": "y"}, {"role": "assistant", "content": "z"}]}, "nope"]
    c = normalize(rows)
    assert len(c.conversations) == 10 and c.num_rows == 14
    assert sum(c.malformed.values()) == 4
    assert c.malformed["user/assistant turns do not alternate"] == 1
    assert c.examples["no conversations/messages/prompt field"] == 11
    with pytest.raises(MalformedRow):
        to_messages({"messages": [{"role": "user", "content": 3}]})


def test_build_data_reports_and_refuses_mostly_malformed(tok, tmp_path):
    good = conversations(20)
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in good + [{"conversations": [{"from": "gpt", "value": "x"}]}]))
    d = build_data(DataConfig(path=str(p), max_rows=None, heldout_size=4, cache_dir=str(tmp_path / "c")), tok,
                   log=lambda *_: None)
    assert d.report["malformed"] == {"conversation does not start with a user turn": 1}
    assert len(d.train) + len(d.heldout) == 20 and len(d.heldout) == 2
    assert d.report["train_loss_tokens"] == sum(sum(m) for m in d.train["loss_mask"])
    # cached: a second build reads the same data back
    again = build_data(DataConfig(path=str(p), max_rows=None, heldout_size=4, cache_dir=str(tmp_path / "c")), tok,
                       log=lambda *_: None)
    assert again.train["input_ids"] == d.train["input_ids"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps({"conversations": [{"from": "gpt", "value": "x"}]}) for _ in range(5)))
    with pytest.raises(ValueError, match="malformed"):
        build_data(DataConfig(path=str(bad), max_rows=None, cache_dir=str(tmp_path / "c")), tok, log=lambda *_: None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_data(DataConfig(path="./missing.jsonl", cache_dir=str(tmp_path / "c")), tok, log=lambda *_: None)


def test_packing_preserves_tokens_and_masks():
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
                                     "loss_mask": [[0, 1, 0], [1, 0], [0, 1, 1, 0]]})
    packed = pack(ds, 4)
    assert sum(packed["input_ids"], []) == list(range(1, 10))
    assert sum(packed["loss_mask"], []) == [0, 1, 0, 1, 0, 0, 1, 1, 0]
    assert all(len(r) <= 4 for r in packed["input_ids"])


def test_collate_pads_right_with_zero_masks():
    b = collate([{"input_ids": [5, 6, 7], "loss_mask": [1, 1, 0]}, {"input_ids": [8], "loss_mask": [0]}], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["loss_mask"].tolist() == [[1, 1, 0], [0, 0, 0]]


def test_loader_is_a_function_of_the_step_and_shards_disjointly():
    ds = [{"input_ids": [i], "loss_mask": [1]} for i in range(40)]
    a = StepBatches(ds, 2, 2, 0, seed=3)
    assert a.steps_per_epoch == 10

    def ids(mbs):
        return [x for mb in mbs for x in mb["input_ids"][:, 0].tolist()]

    epoch0 = sum((ids(a.micro_batches(s)) for s in range(10)), [])
    assert sorted(epoch0) == list(range(40))  # an epoch visits every example once
    assert ids(StepBatches(ds, 2, 2, 0, seed=3).micro_batches(13)) == ids(a.micro_batches(13))  # resume-exact
    assert ids(a.micro_batches(10)) != ids(a.micro_batches(0))  # new permutation each epoch
    r0, r1 = (StepBatches(ds, 2, 2, 0, seed=3, rank=r, world_size=2) for r in (0, 1))
    s0 = sum((ids(r0.micro_batches(s)) for s in range(r0.steps_per_epoch)), [])
    s1 = sum((ids(r1.micro_batches(s)) for s in range(r1.steps_per_epoch)), [])
    assert not set(s0) & set(s1) and len(s0) == len(s1) == 20
    with pytest.raises(ValueError, match="too few"):
        StepBatches(ds[:3], 2, 2, 0)


def test_one_malformed_line_is_one_skipped_row_named_by_its_line(tok, tmp_path):
    """One bad JSON line among 20 good rows skips that row, not the whole file (datasets would raise
    DatasetGenerationError)."""
    lines = [json.dumps(r) for r in conversations(20)]
    lines.insert(6, '{"conversations": [{"from": "human", "value": "hi"')  # line 7: cut off mid-object
    p = tmp_path / "one_bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    logged = []
    d = build_data(DataConfig(path=str(p), max_rows=None, heldout_size=4, cache_dir=str(tmp_path / "c")), tok,
                   log=logged.append)
    print("\n".join(logged))
    assert d.report["rows"] == 21 and d.report["kept"] == 20
    assert d.report["malformed"] == {"invalid JSON": 1}
    first = d.report["malformed_rows"][0]
    assert first["line"] == 7 and first["reason"].startswith("invalid JSON")
    assert len(d.train) + len(d.heldout) == 20
    assert any("line 7" in m for m in logged)


def test_a_mostly_unreadable_jsonl_is_still_refused(tok, tmp_path):
    p = tmp_path / "mostly_bad.jsonl"
    p.write_text("\n".join([json.dumps(conversations(1)[0])] + ["{not json"] * 5))
    with pytest.raises(ValueError, match="max_malformed_fraction") as e:
        build_data(DataConfig(path=str(p), max_rows=None, cache_dir=str(tmp_path / "c")), tok, log=lambda *_: None)
    print(e.value)


@pytest.mark.parametrize("name,text", [("empty.jsonl", ""), ("blank.jsonl", "\n\n  \n"), ("empty.json", ""),
                                       ("empty.parquet", "")])
def test_an_empty_data_file_gets_a_clear_error(tok, tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError, match="is empty|holds no rows") as e:
        build_data(DataConfig(path=str(p), max_rows=None, cache_dir=str(tmp_path / "c")), tok, log=lambda *_: None)
    print(e.value)


def test_an_empty_prompts_file_gets_a_clear_error(tmp_path):
    from specdistill.data.prompts import load_prompt_messages

    p = tmp_path / "prompts.jsonl"
    p.write_text("")
    with pytest.raises(ValueError, match="is empty") as e:
        load_prompt_messages(str(p), num_prompts=3)
    print(e.value)


def test_a_missing_relative_data_path_is_local(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="never looked up on the Hub"):
        build_data(DataConfig(path="data/typo.jsonl", cache_dir=str(tmp_path / "c")), tok, log=lambda *_: None)
