"""Routing profiler: counts sum to tokens x top-k, masses to tokens, hot-expert selection by coverage or count."""
import json

import pytest

from specdistill.moe.profiler import RoutingProfile, plot_heatmap, profile_routing
from tests.moe.conftest import random_batch


@pytest.mark.parametrize("selection", ["loss_mask", "all"])
def test_counts_sum_to_tokens_times_top_k(tiny_moe, selection):
    batches = [random_batch(tiny_moe.config.vocab_size, seed=s) for s in range(2)]
    prof = profile_routing(tiny_moe, batches, selection)
    key = "loss_mask" if selection == "loss_mask" else "attention_mask"
    n = sum(int(b[key].sum()) for b in batches)
    assert prof.tokens == n and prof.layers == list(range(tiny_moe.config.num_hidden_layers))
    for r in range(len(prof.layers)):
        assert sum(prof.counts[r]) == n * prof.top_k
        assert sum(prof.prob_mass[r]) == pytest.approx(n, rel=1e-9)  # full softmax sums to 1 per token
        if getattr(tiny_moe.config, "norm_topk_prob", True):  # Mixtral renormalises top-k: weights sum to 1
            assert sum(prof.weight_mass[r]) == pytest.approx(n, rel=1e-5)
        else:  # Qwen3-MoE norm_topk_prob=false: the applied weights are the raw top-k probabilities
            assert 0 < sum(prof.weight_mass[r]) < n


def test_hot_experts_by_coverage_and_count():
    prof = RoutingProfile("x", 4, 1, [0], counts=[[5, 1, 3, 1]], weight_mass=[[5.0, 1.0, 3.0, 1.0]],
                          prob_mass=[[5.0, 1.0, 3.0, 1.0]], tokens=10)
    assert prof.ranked(0) == [0, 2, 1, 3]
    assert prof.hot_experts(0, coverage=0.5) == [0]
    assert prof.hot_experts(0, coverage=0.8) == [0, 2]
    assert prof.hot_experts(0, coverage=0.81) == [0, 1, 2]
    assert prof.hot_experts(0, count=3) == [0, 1, 2]
    assert prof.coverage(0, [0, 2]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="exactly one"):
        prof.hot_experts(0, coverage=0.5, count=1)
    with pytest.raises(ValueError, match="not an MoE layer"):
        prof.hot_experts(3, count=1)


def test_profile_json_roundtrip_and_heatmap(tiny_moe, tmp_path):
    prof = profile_routing(tiny_moe, [random_batch(tiny_moe.config.vocab_size)])
    path = prof.save(tmp_path / "p.json")
    d = json.loads(path.read_text())
    assert [s["layer"] for s in d["summary"]] == prof.layers and 0.9 <= d["summary"][0]["coverage"] <= 1.0
    again = RoutingProfile.load(path)
    assert again.counts == prof.counts and again.weight_mass == prof.weight_mass
    png = plot_heatmap(prof, tmp_path / "h.png")
    assert png.stat().st_size > 1000


def test_dense_model_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="no sparse MoE layers"):
        profile_routing(dense, [random_batch(50)])
