"""The store-to-peer-format writers on a tiny model, checked against the fields each peer's reader documents:
speculators (datasets folder + hs_<i>.safetensors with the PRE-norm final layer), SpecForge (.ckpt with the post-norm
final state) and ModelOpt (.pt dump), and the answer masks each peer indexes differently. No peer is installed."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.peers import writers
from tests.conftest import make_tiny_lm


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama and five rows (ids, prompt lengths) for it."""
    torch.manual_seed(0)
    model = make_tiny_lm(97, layers=4, hidden=32).eval()
    g = torch.Generator().manual_seed(1)
    rows, plens = [], []
    for n, p in ((9, 4), (12, 5), (7, 3), (10, 6), (8, 2)):
        rows.append(torch.randint(3, 97, (n,), generator=g))
        plens.append(p)
    return model, rows, plens


@pytest.fixture()
def store(tiny, tmp_path):
    """A two-part store of the rows' features (aux of layers [1, 2, 3], post-norm final) in the store's own format."""
    from specdistill.data.regenerated import write_part
    from specdistill.pipeline.regenerate import recapture_rows

    model, rows, plens = tiny
    L = model.config.num_hidden_layers
    layers = [1, 2, 3, L]
    parts = recapture_rows(model, rows[:3], plens[:3], layers, 3 * 32, pad=0), \
        recapture_rows(model, rows[3:], plens[3:], layers, 3 * 32, pad=0)
    for i, part in enumerate(parts):
        write_part(writers.Path(tmp_path) / f"part-{i:05d}.safetensors", part)
    return tmp_path


def test_answer_mask_scores_exactly_the_answer_tokens_at_each_peers_offset():
    T, P = 8, 3
    for offset in (1, 2):
        m = writers.answer_mask(T, P, offset)
        scored = {p + offset for p in range(T) if m[p]}  # the token each set position's prediction is of
        assert scored == set(range(P, T))  # every answer token, nothing of the prompt, nothing past the row
    from specdistill.data.regenerated import loss_mask_for

    assert writers.answer_mask(T, P, 1).tolist() == loss_mask_for(T, P)  # offset 1 is specdistill's own mask


def test_heldout_rows_match_the_trainer():
    assert writers.heldout_rows(800, 32) == 32 and writers.heldout_rows(20, 32) == 2 and writers.heldout_rows(5, 0) == 0


def test_read_rows_round_trips_the_store(tiny, store):
    _, rows, plens = tiny
    got = writers.read_rows(store)
    assert [r.ids.tolist() for r in got] == [r.tolist() for r in rows]
    assert [r.prompt_length for r in got] == plens and [r.part for r in got] == [0, 0, 0, 1, 1]
    assert got[0].aux.shape == (9, 96) and got[0].final.shape == (9, 32) and got[0].aux.dtype == torch.bfloat16


def test_speculators_format(tiny, store, tmp_path):
    import datasets
    import numpy as np
    from safetensors.torch import load_file

    model, rows, _ = tiny
    all_rows = writers.read_rows(store)
    train, held = all_rows[:4], all_rows[4:]
    d2t = torch.tensor([0, 1, 3, 3])  # draft ids 0..3 -> target ids 0, 2, 5, 6
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[[0, 2, 5, 6]] = True
    out = tmp_path / "spec"
    meta = writers.write_speculators(train, held, out, model, d2t, t2d, log=lambda m: None)
    ds = datasets.load_from_disk(str(out))
    assert set(ds.column_names) == {"input_ids", "loss_mask", "seq_len"} and len(ds) == 5
    assert torch.equal(ds[1]["input_ids"], rows[1])  # torch format, as its ArrowDataset compares with torch.equal
    assert ds[1]["loss_mask"].tolist() == writers.answer_mask(12, 5, 1).tolist()
    assert int(len(ds) * meta["train_data_ratio"]) == 4  # its train/val split falls at our held-out rows
    norm = writers.final_norm(model)
    for i, r in enumerate(all_rows):
        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(hs) == {"token_ids", "hidden_states"} and torch.equal(hs["token_ids"], r.ids)
        assert hs["hidden_states"].shape == (len(r.ids), 4, 32)  # 3 aux layers then the final layer
        assert torch.equal(hs["hidden_states"][:, :3].flatten(1), r.aux)
        pre = hs["hidden_states"][:-1, 3].float()  # the last slot was never fed when the store was written
        with torch.no_grad():  # pre-norm: the target's norm gives the store's post-norm state
            torch.testing.assert_close(norm(pre), r.final[:-1].float(), atol=0.05, rtol=0.05)
    assert np.load(meta["d2t_path"]).tolist() == d2t.tolist() and np.load(meta["t2d_path"]).sum() == 4
    assert json.loads((out / "specdistill_peer_data.json").read_text())["loss_tokens"] == writers.answer_tokens(train)


def test_speculators_refuses_a_store_of_another_target(tiny, store, tmp_path):
    other = make_tiny_lm(97, layers=4, hidden=32, seed=5).eval()
    with torch.no_grad():  # another target's final norm (a random init has all-ones weights, like the store's)
        other.model.norm.weight.copy_(torch.linspace(0.5, 2.0, 32))
    rows = writers.read_rows(store)
    with pytest.raises(ValueError, match="another target"):
        writers.write_speculators(rows[:2], rows[2:3], tmp_path / "x", other, torch.zeros(4, dtype=torch.long),
                                  torch.ones(97, dtype=torch.bool), log=lambda m: None)


def test_prenorm_from_postnorm_gives_the_post_norm_state_back_through_the_norm():
    """Against a real pre-norm state: RMSNorm(final / w) equals RMSNorm(h) = final, w with mixed signs and a zero."""
    model = make_tiny_lm(97, layers=2, hidden=32, seed=3).eval()
    norm = writers.final_norm(model)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-1.5, 2.0, 32))
        norm.weight[7] = 0.0
        h = torch.randn(6, 32) * 3.0
        final = norm(h)
        pre = writers.prenorm_from_postnorm(final, norm.weight)
        torch.testing.assert_close(norm(pre), final, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(pre, h, atol=1e-2)  # the per-token scale is not recovered: RMSNorm ignores it


def test_specforge_format(store, tmp_path):
    rows = writers.read_rows(store)
    d2t, t2d = torch.zeros(97, dtype=torch.long), torch.ones(97, dtype=torch.bool)
    meta = writers.write_specforge(rows, tmp_path / "sf", d2t, t2d, log=lambda m: None)
    files = sorted((tmp_path / "sf" / "features").glob("*.ckpt"))
    assert len(files) == 5
    for f, r in zip(files, rows):
        d = torch.load(f, weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert d["hidden_state"].shape == (1, len(r.ids), 32) and d["aux_hidden_state"].shape == (1, len(r.ids), 96)
        assert torch.equal(d["hidden_state"][0], r.final)  # post-norm: SpecForge applies the lm_head directly
        # slot t reads token t + 1 and predicts token t + 2: set iff that token is an answer token
        assert d["loss_mask"].tolist() == [int(r.prompt_length <= t + 2 < len(r.ids)) for t in range(len(r.ids))]
    vm = torch.load(meta["vocab_map"], weights_only=True)
    assert set(vm) == {"d2t", "t2d"}  # what its Eagle3DraftModel.load_vocab_mapping reads


def test_modelopt_format(store, tmp_path):
    rows = writers.read_rows(store)
    d2t = torch.arange(4) * 2
    meta = writers.write_modelopt(rows, tmp_path / "mo", d2t, log=lambda m: None)
    files = sorted((tmp_path / "mo" / "dump").glob("*.pt"))
    for f, r in zip(files, rows):
        d = torch.load(f, weights_only=True)  # its OfflineSupervisedDataset loads with weights_only=True
        assert set(d) == {"input_ids", "hidden_states", "aux_hidden_states", "loss_mask"}
        assert d["hidden_states"].shape == (len(r.ids), 32) and d["aux_hidden_states"].shape == (len(r.ids), 96)
        assert d["loss_mask"].tolist() == writers.answer_mask(len(r.ids), r.prompt_length, 1).tolist()
        assert "hidden_states_prenorm" not in d  # absent = post-norm, its default
    assert torch.equal(torch.load(meta["d2t_path"], weights_only=True), d2t)
