"""Offline target features: shards round-trip, logits rebuild exactly, training from them matches online training."""
import importlib.util
from pathlib import Path

import pytest
import torch

from specdistill.build import build
from specdistill.data.features import FeatureStore, FeatureWriter
from specdistill.entry import load_config
from specdistill.models.target import Target
from specdistill.train.loop import fit
from tests.conftest import compose, make_tiny_lm, tiny_overrides


def test_shards_round_trip_and_are_bounded(tmp_path):
    w = FeatureWriter(tmp_path / "f", {"x": 1}, shard_mb=0)  # 0 MB: every example flushes its own shard
    rows = [(torch.randn(n, 6), torch.randn(n, 2)) for n in (3, 5, 1)]
    for a, f in rows:
        w.add(a, f)
    w.close()
    store = FeatureStore(tmp_path / "f")
    assert len(store) == 3 and len(list((tmp_path / "f").glob("shard-*"))) == 3
    for i, (a, f) in enumerate(rows):
        sa, sf = store[i]
        assert torch.equal(sa, a.to(torch.bfloat16)) and torch.equal(sf, f.to(torch.bfloat16))
    with pytest.raises(FileExistsError):
        FeatureWriter(tmp_path / "f", {})
    with pytest.raises(ValueError, match="another setup"):
        store.check_matches({"x": 2})
    with pytest.raises(FileNotFoundError, match="dump_features"):
        FeatureStore(tmp_path / "nope")


def test_logits_rebuild_from_the_final_hidden_state():
    model = make_tiny_lm(50, layers=2).eval()
    t = Target(model, [0, 1, 1])
    ids = torch.randint(0, 50, (2, 7))
    am = torch.ones_like(ids)
    ref = t(ids, am)
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states
    rebuilt = t.outputs({"input_ids": ids, "attention_mask": am, "final_hidden": hs[-1], "aux_hidden": ref.aux_hidden})
    assert torch.allclose(rebuilt.logits, ref.logits, atol=1e-5)


def test_training_from_offline_features_matches_online(tiny_target_dir, tiny_data_file, tmp_path):
    spec = importlib.util.spec_from_file_location("dump", Path(__file__).parent.parent / "scripts" / "dump_features.py")
    dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dump)
    feats = tmp_path / "feats"
    base = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "cache") + [
        "trainer.max_steps=2", "data.max_rows=24", "objective.steps=2"]
    dump.dump(load_config(compose("eagle3", base + [f"data.offline_dir={feats}"])), batch_size=3)
    online = fit(build(compose("eagle3", base + ["trainer.output_dir=" + str(tmp_path / "on")])))
    offline = fit(build(compose("eagle3", base + [f"data.offline_dir={feats}",
                                                  f"trainer.output_dir={tmp_path / 'off'}"])))
    for a, b in zip(online.history, offline.history):  # bf16 storage: close, not identical
        assert abs(a["train/loss"] - b["train/loss"]) < 2e-2 * abs(a["train/loss"])
    # features from other data are refused
    with pytest.raises(ValueError, match="another setup"):
        build(compose("eagle3", base + [f"data.offline_dir={feats}", "data.max_length=48"]))
