"""Expert selection (draft.moe.selection): hot / cold / random pick what they say at one count, and the drafts built
from them keep exactly the chosen experts' router rows and weights, at equal parameter counts."""
import itertools
import json

import pytest
import torch

from specdistill.moe.build import build_moe_draft, draft_param_count, select_experts, selection_record
from specdistill.moe.profiler import RoutingProfile, profile_routing
from tests.moe.conftest import random_batch


def _profile(L=4, E=8, seed=0) -> RoutingProfile:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(L, E, generator=g) ** 3 * 100  # skewed, distinct masses
    return RoutingProfile(model_type="x", num_experts=E, top_k=2, layers=list(range(L)),
                          counts=w.round().long().tolist(), weight_mass=w.tolist(), prob_mass=w.tolist(), tokens=100)


def test_hot_holds_the_most_routing_mass_and_cold_the_least_of_all_subsets():
    prof, k = _profile(), 3
    hot, cold = select_experts(prof, prof.layers, count=k), select_experts(prof, prof.layers, count=k, selection="cold")
    for s in prof.layers:
        covs = [prof.coverage(s, c) for c in itertools.combinations(range(prof.num_experts), k)]
        assert prof.coverage(s, hot[s]) == pytest.approx(max(covs))
        assert prof.coverage(s, cold[s]) == pytest.approx(min(covs))
        assert hot[s] == sorted(hot[s]) and len(set(hot[s]) | set(cold[s])) == 2 * k


def test_random_is_reproducible_uniform_and_differs_from_hot_and_cold():
    prof, k = _profile(), 3
    hot, cold = select_experts(prof, prof.layers, count=k), select_experts(prof, prof.layers, count=k, selection="cold")
    draws = [select_experts(prof, prof.layers, count=k, selection="random", seed=seed) for seed in range(300)]
    assert draws[7] == select_experts(prof, prof.layers, count=k, selection="random", seed=7)
    assert all(len(d[s]) == k and len(set(d[s])) == k for d in draws for s in prof.layers)
    assert any(d[0] not in (hot[0], cold[0]) for d in draws[:3])
    freq = torch.zeros(prof.num_experts)
    for d in draws:
        freq[d[0]] += 1
    # each expert is kept with probability k/E = 0.375; 300 draws: std ~0.028, so +-0.1 is > 3.5 sigma
    assert (freq / len(draws) - k / prof.num_experts).abs().max() < 0.1
    assert any(d[0] != d[1] for d in draws[:5])  # layers draw independently


def test_coverage_sets_one_count_for_every_selection():
    prof = _profile()
    need = max(len(prof.hot_experts(s, coverage=0.8)) for s in prof.layers)
    for sel in ("hot", "random", "cold"):
        got = select_experts(prof, prof.layers, coverage=0.8, selection=sel, seed=1)
        assert {len(v) for v in got.values()} == {need}


def test_bad_selection_or_count_fails_clearly():
    prof = _profile()
    with pytest.raises(ValueError, match="draft.moe.selection='warm'.*hot"):
        select_experts(prof, [0], count=2, selection="warm")
    with pytest.raises(ValueError, match="expert count 9"):
        select_experts(prof, [0], count=9, selection="random")


def test_drafts_keep_the_chosen_rows_at_equal_parameters(tiny_moe, tmp_path):
    prof = profile_routing(tiny_moe, [random_batch(tiny_moe.config.vocab_size)])
    E = prof.num_experts
    k = E // 2
    layers = [0, 1]
    sizes = {}
    for sel in ("hot", "random", "cold"):
        chosen = select_experts(prof, layers, count=k, selection=sel, seed=3)
        draft = build_moe_draft(tiny_moe, layers, chosen)
        sizes[sel] = draft_param_count(draft)
        for j, s in enumerate(layers):
            t, d = tiny_moe.model.layers[s].mlp, draft.model.layers[j].mlp
            ids = torch.tensor(chosen[s])
            assert torch.equal(d.gate.weight, t.gate.weight[ids])  # router rows of exactly the chosen experts
            assert torch.equal(d.experts.gate_up_proj, t.experts.gate_up_proj[ids])
            assert torch.equal(d.experts.down_proj, t.experts.down_proj[ids])
        draft.config.specdistill_moe.update(selection_record(prof, chosen, sel, 3))
        draft.save_pretrained(tmp_path / sel)
        saved = json.loads((tmp_path / sel / "config.json").read_text())["specdistill_moe"]
        assert saved["experts"] == [chosen[s] for s in layers] and saved["selection"] == sel
        assert saved["coverage"] == [round(prof.coverage(s, chosen[s]), 4) for s in layers]
    assert sizes["hot"] == sizes["random"] == sizes["cold"]
    hot = select_experts(prof, layers, count=k)
    dense = build_moe_draft(tiny_moe, layers, hot, kind="dense", profile=prof)
    H = tiny_moe.config.hidden_size
    assert sizes["hot"] - draft_param_count(dense) == len(layers) * (k - 1) * H  # the router rows a dense MLP drops


def test_config_path_records_the_selection(tiny_moe_dirs, tiny_data_file, tmp_path):
    from specdistill.build import build
    from tests.conftest import compose, tiny_overrides

    over = tiny_overrides(tiny_moe_dirs["qwen3_moe"], tiny_data_file, tmp_path / "r", tmp_path / "cache")
    over += ["draft.num_layers=2", "draft.moe.num_experts=3", "draft.moe.coverage=null", "draft.moe.profile_batches=2",
             "draft.moe.selection=cold"]
    c = build(compose("moe_kd", over))
    meta = c.models.draft.config.specdistill_moe
    assert meta["selection"] == "cold" and meta["selection_seed"] is None and len(meta["coverage"]) == 2
    assert all(len(e) == 3 for e in meta["experts"]) and all(0 <= x <= 1 for x in meta["coverage"])


def test_eagle3_mlp_takes_the_selected_experts(tiny_moe):
    from specdistill.drafts.eagle3.model import build_eagle3
    from specdistill.moe.build import init_eagle3_mlp_from_experts, mass_weights, merge_experts

    prof = profile_routing(tiny_moe, [random_batch(tiny_moe.config.vocab_size)])
    L = tiny_moe.config.num_hidden_layers
    head = build_eagle3(tiny_moe, torch.arange(tiny_moe.config.vocab_size), None)
    info = init_eagle3_mlp_from_experts(head, tiny_moe, prof, count=2, selection="cold")
    cold = select_experts(prof, [L - 1], count=2, selection="cold")[L - 1]
    assert info["experts"] == [cold] and info["selection"] == "cold"
    assert info["coverage"] == [round(prof.coverage(L - 1, cold), 4)]
    experts = tiny_moe.model.layers[L - 1].mlp.experts
    w = mass_weights(prof, L - 1, cold)
    gate_up, down = merge_experts([(experts, e, float(x)) for e, x in zip(cold, w)], "concat")
    assert torch.allclose(head.midlayer.mlp.down_proj.weight, down.to(head.midlayer.mlp.down_proj.weight.dtype))
