"""Expert-selective drafts: all experts reproduce the source layers, sliced routers renormalise, dense merges,
EAGLE-3 MLP from experts, equal parameter counts."""
import copy

import pytest
import torch

from specdistill.moe.build import build_moe_draft, draft_param_count, init_eagle3_mlp_from_experts, merge_experts
from specdistill.moe.profiler import profile_routing
from specdistill.moe.routing import expert_forward, moe_blocks
from tests.moe.conftest import random_batch


def _x(model, n=40, seed=1):
    return torch.randn(n, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))


def _all(model, layers):
    E = model.model.layers[0].mlp.gate.weight.shape[0]
    return {s: list(range(E)) for s in layers}


def _identical_experts(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for block in moe_blocks(m).values():
            block.experts.gate_up_proj[:] = block.experts.gate_up_proj[0].clone()
            block.experts.down_proj[:] = block.experts.down_proj[0].clone()
    return m


def test_all_experts_reproduce_the_source_layers_exactly(tiny_moe):
    b = random_batch(tiny_moe.config.vocab_size)
    # a prefix of layers: the whole draft equals the target truncated to those layers
    draft = build_moe_draft(tiny_moe, [0, 1], _all(tiny_moe, [0, 1]))
    trunc = copy.deepcopy(tiny_moe)
    trunc.model.layers = trunc.model.layers[:2]
    trunc.config.num_hidden_layers = 2
    with torch.no_grad():
        assert torch.equal(draft(**{k: b[k] for k in ("input_ids", "attention_mask")}).logits,
                           trunc(**{k: b[k] for k in ("input_ids", "attention_mask")}).logits)
    # any layer selection: each draft block computes its source block
    draft = build_moe_draft(tiny_moe, [2, 0], _all(tiny_moe, [2, 0]))
    x = _x(tiny_moe)[None]
    with torch.no_grad():
        for j, s in enumerate([2, 0]):
            assert torch.equal(draft.model.layers[j].mlp(x), tiny_moe.model.layers[s].mlp(x))
            assert torch.equal(draft.model.layers[j].input_layernorm.weight,
                               tiny_moe.model.layers[s].input_layernorm.weight)
    assert draft.config.specdistill_moe["source_layers"] == [2, 0]


def test_sliced_router_renormalises_over_kept_experts(tiny_moe):
    s, E = 1, tiny_moe.model.layers[0].mlp.gate.weight.shape[0]
    kept = [0, 2] if E == 4 else [0, 2, 3, 5, 6]
    draft = build_moe_draft(tiny_moe, [s], {s: kept})
    x = _x(tiny_moe, n=400)
    t_gate, d_gate = tiny_moe.model.layers[s].mlp.gate, draft.model.layers[0].mlp.gate
    with torch.no_grad():
        t_logits, t_w, t_idx = t_gate(x)
        d_logits, d_w, d_idx = d_gate(x)
        # the draft's softmax is the target's distribution conditioned on the kept experts
        p = torch.softmax(t_logits.float(), -1)[:, kept]
        assert torch.allclose(torch.softmax(d_logits.float(), -1), p / p.sum(-1, keepdim=True), atol=1e-6)
        k_draft = min(tiny_moe.config.num_experts_per_tok, len(kept))
        assert d_idx.shape[1] == k_draft and draft.config.num_experts_per_tok == k_draft
        kept_t = torch.tensor(kept)
        inside = torch.isin(t_idx, kept_t).all(-1)  # tokens whose target top-k all survive
        assert inside.any() and (~inside).any()
        mapped = kept_t[d_idx]  # draft expert ids -> target expert ids
        assert torch.equal(mapped[inside].sort(-1).values, t_idx[inside].sort(-1).values)
        if getattr(tiny_moe.config, "norm_topk_prob", True):
            # renormalised top-k: those tokens get exactly the target's weights, hence the target block's output
            tw = torch.zeros(len(x), E).scatter(1, t_idx, t_w.float())[inside][:, kept]
            dw = torch.zeros(len(x), len(kept)).scatter(1, d_idx, d_w.float())[inside]
            assert torch.allclose(tw, dw, atol=1e-6)
            yt, yd = tiny_moe.model.layers[s].mlp(x[None])[0], draft.model.layers[0].mlp(x[None])[0]
            assert torch.allclose(yt[inside], yd[inside], atol=1e-6)
            assert not torch.allclose(yt[~inside], yd[~inside], atol=1e-4)
        else:  # raw top-k probabilities: draft weight = target weight / (target's mass on the kept experts)
            tw = torch.zeros(len(x), E).scatter(1, t_idx, t_w.float())[inside][:, kept]
            dw = torch.zeros(len(x), len(kept)).scatter(1, d_idx, d_w.float())[inside]
            assert torch.allclose(dw, tw / p[inside].sum(-1, keepdim=True), atol=1e-5)


@pytest.mark.parametrize("merge", ["concat", "average"])
def test_dense_merge_of_identical_experts_is_the_moe_block(tiny_moe, merge):
    target = _identical_experts(tiny_moe)
    prof = profile_routing(target, [random_batch(target.config.vocab_size)])
    E = target.model.layers[0].mlp.gate.weight.shape[0]
    kept = {0: [0, 1, 2], 1: [1, 2, 3]}
    draft = build_moe_draft(target, [0, 1], kept, kind="dense", merge=merge, profile=prof)
    x = _x(target)[None]
    with torch.no_grad():
        for j in range(2):
            yt, yd = target.model.layers[j].mlp(x), draft.model.layers[j].mlp(x)
            if target.config.norm_topk_prob if hasattr(target.config, "norm_topk_prob") else True:
                assert torch.allclose(yt, yd, atol=1e-5)
            else:  # raw top-k weights sum to < 1: the block is a scaled expert; the merge is the expert itself
                f = expert_forward(target.model.layers[j].mlp.experts, 0, x[0])
                assert torch.allclose(yd[0], f, atol=1e-5)
    assert draft.config.specdistill_moe["kind"] == "dense" and E >= 4


def test_concat_merge_is_mass_weighted_mean_of_expert_outputs(tiny_moe):
    ex = tiny_moe.model.layers[0].mlp.experts
    ws = [0.5, 0.3, 0.2]
    gate_up, down = merge_experts([(ex, e, w) for e, w in zip([0, 1, 3], ws)], "concat")
    x = _x(tiny_moe)
    g, u = torch.nn.functional.linear(x, gate_up).chunk(2, -1)
    merged = torch.nn.functional.linear(ex.act_fn(g) * u, down)
    want = sum(w * expert_forward(ex, e, x) for e, w in zip([0, 1, 3], ws))
    assert torch.allclose(merged, want, atol=1e-5)


def test_dense_concat_draft_has_the_moe_drafts_parameter_count(tiny_moe):
    prof = profile_routing(tiny_moe, [random_batch(tiny_moe.config.vocab_size)])
    kept = {0: [0, 1, 2], 1: [0, 2, 3]}
    moe = build_moe_draft(tiny_moe, [0, 1], kept)
    dense = build_moe_draft(tiny_moe, [0, 1], kept, kind="dense", profile=prof)
    H = tiny_moe.config.hidden_size
    assert draft_param_count(moe) - draft_param_count(dense) == 2 * (3 - 1) * H  # only the router rows differ


def test_eagle3_mlp_from_hot_experts(tiny_moe, tmp_path):
    from specdistill.drafts.eagle3.model import Eagle3Head, build_eagle3

    target = _identical_experts(tiny_moe)
    prof = profile_routing(target, [random_batch(target.config.vocab_size)])
    head = build_eagle3(target, torch.arange(target.config.vocab_size), None)
    info = init_eagle3_mlp_from_experts(head, target, prof, count=2)
    L = target.config.num_hidden_layers
    assert info["layers"] == [L - 1] and len(info["experts"][0]) == 2
    I = target.model.layers[0].mlp.experts.gate_up_proj.shape[1] // 2
    assert head.config.intermediate_size == 2 * I and head.midlayer.mlp.down_proj.weight.shape[1] == 2 * I
    x = _x(target)
    with torch.no_grad():  # identical experts, weights summing to 1: the merged MLP is the expert
        assert torch.allclose(head.midlayer.mlp(x), expert_forward(target.model.layers[L - 1].mlp.experts, 0, x),
                              atol=1e-5)
    head.save_pretrained(tmp_path / "head")  # the merged size travels in config.json
    again = Eagle3Head.from_pretrained(tmp_path / "head")
    assert again.config.intermediate_size == 2 * I
    assert torch.equal(again.midlayer.mlp.down_proj.weight, head.midlayer.mlp.down_proj.weight)


def test_bad_selections_fail_clearly(tiny_moe):
    with pytest.raises(ValueError, match="same number of experts"):
        build_moe_draft(tiny_moe, [0, 1], {0: [0, 1], 1: [0]})
    with pytest.raises(ValueError, match="not MoE layers"):
        build_moe_draft(tiny_moe, [7], {7: [0]})
    with pytest.raises(ValueError, match="routing profile"):
        build_moe_draft(tiny_moe, [0], {0: [0, 1]}, kind="dense")


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_other_families_profile_and_reproduce(family):
    """Qwen2-MoE (shared expert) and OLMoE: the same router/experts layout, so the same code paths hold."""
    from transformers import OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    if family == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=16,
                                                   shared_expert_intermediate_size=24, **common)).eval()
    else:
        model = OlmoeForCausalLM(OlmoeConfig(intermediate_size=16, **common)).eval()
    b = random_batch(64)
    prof = profile_routing(model, [b], "all")
    n = int(b["attention_mask"].sum())
    assert all(sum(c) == 2 * n for c in prof.counts)
    draft = build_moe_draft(model, [1], {1: [0, 1, 2, 3]})
    x = _x(model)[None]
    with torch.no_grad():
        assert torch.equal(draft.model.layers[0].mlp(x), model.model.layers[1].mlp(x))
