"""Regeneration with features (pipeline/regenerate.py, data/regenerated.py): the store's features are the target's,
its rows are the target's greedy answers, it resumes and extends part by part, and a changed setting misses."""
import json

import pytest
import torch

from specdistill.config import RegenerateConfig
from specdistill.data.regenerated import RegeneratedStore, loss_mask_for, part_path
from specdistill.pipeline.regenerate import regenerate_store
from tests.conftest import make_tiny_lm, make_tokenizer

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    tok = make_tokenizer()
    return make_tiny_lm(len(tok), layers=4).eval(), tok


def _cfg(data_file, tmp_path, **kw):
    base = dict(enabled=True, prompts=str(data_file), max_prompts=12, max_new_tokens=10, batch_size=4,
                store_dir=str(tmp_path / "store"))
    base.update(kw)
    return RegenerateConfig(**base)


def _store(tiny, cfg):
    model, tok = tiny
    root, parts = regenerate_store(cfg, model, tok, "tiny", AUX, log=lambda *_: None, progress=False)
    return root, RegeneratedStore(root, parts)


def test_features_equal_a_fresh_forward_and_rows_are_greedy_answers(tiny, tiny_data_file, tmp_path):
    model, tok = tiny
    _, store = _store(tiny, _cfg(tiny_data_file, tmp_path))
    assert len(store) == 12 and store.greedy
    for i in (0, 5, 11):
        row = store[i]
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[k] for k in AUX], -1)[0]  # (T, 3H)
        final = out.hidden_states[-1][0]
        # every fed position (all but the last) carries the target's features (stored in bf16)
        torch.testing.assert_close(row["aux_hidden"][:-1].float(), aux[:-1], atol=0.05, rtol=0.02)
        torch.testing.assert_close(row["final_hidden"][:-1].float(), final[:-1], atol=0.05, rtol=0.02)
        lm = torch.tensor(row["loss_mask"]).bool()
        assert lm.sum() >= 1 and not lm[-1]
        # greedy: at every answer position the target's argmax is the stored next token and the stored argmax
        argmax = out.logits[0].argmax(-1)
        assert torch.equal(argmax[lm], ids[0, 1:][lm[:-1]])
        assert torch.equal(row["target_argmax"][lm], argmax[lm])


def test_loss_mask_marks_the_answer_predictions():
    # prompt of 3 tokens, 2 answer tokens: positions 2 and 3 predict answer tokens 3 and 4
    assert loss_mask_for(5, 3) == [0, 0, 1, 1, 0]


def test_store_is_reused_extended_resumed_and_keyed_by_settings(tiny, tiny_data_file, tmp_path):
    cfg = _cfg(tiny_data_file, tmp_path)
    root, store = _store(tiny, cfg)
    stamps = {i: part_path(root, i).stat().st_mtime_ns for i in range(3)}
    first_rows = [store[i]["input_ids"] for i in range(len(store))]
    # same settings: nothing is decoded again
    root2, _ = _store(tiny, cfg)
    assert root2 == root and {i: part_path(root, i).stat().st_mtime_ns for i in range(3)} == stamps
    # more prompts: the existing parts are kept byte for byte, only new ones are decoded
    root3, bigger = _store(tiny, _cfg(tiny_data_file, tmp_path, max_prompts=20))
    assert root3 == root and len(bigger) == 20
    assert {i: part_path(root, i).stat().st_mtime_ns for i in range(3)} == stamps
    assert [bigger[i]["input_ids"] for i in range(12)] == first_rows
    # an interrupted run (a part missing) decodes that part again, identically
    part_path(root, 1).unlink()
    _, again = _store(tiny, cfg)
    assert [again[i]["input_ids"] for i in range(12)] == first_rows
    # a changed setting is another store
    root4, _ = _store(tiny, _cfg(tiny_data_file, tmp_path, max_new_tokens=6))
    assert root4 != root
    assert json.loads((root4 / "settings.json").read_text())["settings"]["max_new_tokens"] == 6


def test_a_missing_part_is_a_clear_error(tiny, tiny_data_file, tmp_path):
    root, _ = _store(tiny, _cfg(tiny_data_file, tmp_path))
    part_path(root, 2).unlink()
    with pytest.raises(FileNotFoundError, match="lacks parts"):
        RegeneratedStore(root, 3)


def test_the_serving_recipe_runs_end_to_end_on_a_tiny_target(tiny_target_dir, tiny_data_file, tmp_path):
    """recipe=eagle3_serve as a user runs it: regenerate (with features) -> train -> one final speculative eval ->
    vLLM and SGLang exports; a second run reuses the regenerated store."""
    from specdistill.pipeline.run import run
    from tests.conftest import compose, tiny_overrides

    out = tmp_path / "run"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + [
        "trainer.max_steps=2", "trainer.epochs=null", "eval.spec_eval=true", "eval.spec_eval_at=end",
        "eval.num_prompts=2", "eval.max_new_tokens=6", "eval.prompts=" + str(tiny_data_file), "eval.gamma=2"]
    res = run(compose("eagle3_serve", over))
    assert res.step == 2 and res.preempted is None
    final = json.loads((out / "eval" / "final" / "results.json").read_text())
    assert final["mean_accept_len"] >= 1.0 and final["greedy_mismatches"] == 0
    for fmt in ("vllm", "sglang"):
        cfg = json.loads((out / "export" / fmt / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    report = json.loads((out / "data_report.json").read_text())
    assert report["source"].startswith("regenerated:") and report["train_loss_tokens"] > 0
    stores = list((tmp_path / "cache" / "regenerated").iterdir())
    assert len(stores) == 1
    stamps = {p.name: p.stat().st_mtime_ns for p in stores[0].glob("part-*")}
    run(compose("eagle3_serve", over[:-8] + ["trainer.max_steps=1", f"trainer.output_dir={tmp_path / 'again'}"]))
    assert {p.name: p.stat().st_mtime_ns for p in stores[0].glob("part-*")} == stamps  # reused, not decoded again


def test_other_aux_layers_recapture_the_same_answers_by_prefill(tiny, tiny_data_file, tmp_path, monkeypatch):
    """target.aux_layer_ids changed: the answers another store holds are reused, their features recomputed by one
    prefill (nothing decoded), equal to decoding afresh with those layers; parts the donor lacks are decoded."""
    import specdistill.decoding as decoding

    model, tok = tiny
    cfg = _cfg(tiny_data_file, tmp_path)
    donor, old = _store(tiny, cfg)
    other = [0, 2, 3]

    def no_decoding(*a, **k):
        raise AssertionError("decoded although the answers exist")

    with monkeypatch.context() as m:
        m.setattr(decoding, "target_generate", no_decoding)
        root, parts = regenerate_store(cfg, model, tok, "tiny", other, log=lambda *_: None, progress=False)
    assert root != donor
    new = RegeneratedStore(root, parts)
    # what decoding with the new layers writes, in a store of its own
    fresh_cfg = _cfg(tiny_data_file, tmp_path / "fresh")
    froot, fparts = regenerate_store(fresh_cfg, model, tok, "tiny", other, log=lambda *_: None, progress=False)
    fresh = RegeneratedStore(froot, fparts)
    assert len(new) == len(old) == len(fresh) == 12
    for i in range(12):
        a, b = new[i], fresh[i]
        assert a["input_ids"] == old[i]["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
        torch.testing.assert_close(a["aux_hidden"].float(), b["aux_hidden"].float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(a["final_hidden"].float(), b["final_hidden"].float(), atol=0.05, rtol=0.02)
    # the aux features are those of the new layers (the embeddings, hidden_states[0]), not the donor's
    ids = torch.tensor([new[3]["input_ids"]])
    with torch.no_grad():
        emb = model(input_ids=ids, output_hidden_states=True).hidden_states[0][0]
    torch.testing.assert_close(new[3]["aux_hidden"][:-1, :emb.shape[1]].float(), emb[:-1], atol=0.05, rtol=0.02)
    # more prompts than the donor holds: its parts are recaptured, the rest decoded
    bigger_root, bigger_parts = regenerate_store(_cfg(tiny_data_file, tmp_path, max_prompts=20), model, tok, "tiny",
                                                 other, log=lambda *_: None, progress=False)
    assert bigger_root == root and len(RegeneratedStore(bigger_root, bigger_parts)) == 20
