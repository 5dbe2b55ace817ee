"""specdistill-regenerate (cli/regenerate.py): assistant turns are the target's greedy answers; a cut file resumes."""
import json

import torch

from specdistill.cli import regenerate as regen
from specdistill.data.chat import prompt_ids
from tests.conftest import make_tiny_lm, make_tokenizer


def test_turns_are_the_targets_greedy_answers():
    tok = make_tokenizer()
    model = make_tiny_lm(len(tok), layers=2).eval()
    convs = [[{"role": "user", "content": "hello what is two"}, {"role": "assistant", "content": "old"},
              {"role": "user", "content": "why"}, {"role": "assistant", "content": "old too"}],
             [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "old"}]]
    new = regen.regenerate_batch(model, tok, convs, max_new_tokens=6, temperature=0.0, max_context=512)
    assert [m["role"] for m in new[0]] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in new[1]] == ["user", "assistant"]
    # the first answer is exactly the target's greedy continuation of the prompt
    ids = torch.tensor([prompt_ids(tok, convs[1][:1])])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    ref = [t for t in ref if t != tok.eos_token_id]
    assert new[1][1]["content"] == tok.decode(ref, skip_special_tokens=True).strip()
    assert all(m["content"] != "old" for c in new for m in c)


def test_done_ids_resumes_and_cuts_a_torn_line(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"id": "a", "messages": []}) + "\n" + json.dumps({"id": "b", "messages": []}) + "\n"
                   + '{"id": "c", "mess')
    assert regen.done_ids(out) == {"a", "b"}
    assert out.read_text().endswith("\n") and len(out.read_text().splitlines()) == 2
