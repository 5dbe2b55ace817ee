"""Dense -> MoE conversion (moe/convert.py, router_fit.py, realness.py, cli/moefy.py) on tiny random Llama models and
a planted-structure MLP: exactness when every expert is active, balanced clustering that finds planted groups, a
router that ranks groups far better than chance, the HF round trip through the profiler and the draft builders,
the CLI's cache and its errors for bad settings."""
import json

import pytest
import torch
from torch import nn

from specdistill.moe.build import build_moe_draft
from specdistill.moe.convert import (MoefyConfig, balanced_assign, balanced_kmeans, check_dense_llama,
                                     coactivation_patterns, convert_layer, moefy)
from specdistill.moe.profiler import profile_routing
from specdistill.moe.realness import is_code_like, jaccard, merge_profiles, usage_entropy
from tests.conftest import conversations, make_tiny_lm
from tests.moe.conftest import random_batch


def _batches(vocab, n=4, B=4, T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, vocab, (B, T), generator=g),
             "attention_mask": torch.ones(B, T, dtype=torch.long)} for _ in range(n)]


@pytest.fixture(scope="module")
def dense(moe_tokenizer):
    return make_tiny_lm(len(moe_tokenizer), layers=2, hidden=32).eval()  # intermediate 64


@pytest.mark.parametrize("E,k", [(1, 1), (4, 4)])
def test_all_experts_active_reproduces_the_dense_model(dense, E, k):
    conv = moefy(dense, _batches(dense.config.vocab_size), MoefyConfig(num_experts=E, top_k=k, tokens=256))
    b = random_batch(dense.config.vocab_size)
    inp = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    with torch.no_grad():
        ref, out = dense(**inp).logits, conv.model(**inp).logits
    assert type(conv.model).__name__ == "MixtralForCausalLM"
    assert conv.model.config.intermediate_size == 64 // E and conv.model.config.num_experts_per_tok == k
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for fit in conv.layers:  # the experts partition the neurons
        assert sorted(fit.groups.flatten().tolist()) == list(range(64))


def test_upcycling_shares_the_helpers_and_still_computes_the_dense_model(dense):
    from specdistill.moe.upcycle import upcycle_llama

    moe = upcycle_llama(dense, num_experts=3, top_k=2)
    b = random_batch(dense.config.vocab_size)
    inp = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    with torch.no_grad():
        torch.testing.assert_close(moe(**inp).logits, dense(**inp).logits, rtol=1e-5, atol=1e-5)


def test_balanced_assignment_fills_every_cluster_exactly():
    sim = torch.zeros(12, 3)
    sim[:, 0] = 1.0  # every point prefers cluster 0
    assign = balanced_assign(sim, 4)
    assert torch.bincount(assign, minlength=3).tolist() == [4, 4, 4]
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_assign(torch.zeros(10, 3), 4)


# ---------------------------------------------------------------- planted structure
def _planted_mlp(H=32, I=64, E=4, N=2048, seed=0):
    """An MLP whose neurons come in E planted groups, each firing on one token type, and tokens of mixed types:
    x = 3 mu_dominant + U(0, 1.5) mu_other + noise. The group with the largest output is the dominant type's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    g = torch.Generator().manual_seed(seed)
    mu = torch.linalg.qr(torch.randn(H, H, generator=g))[0][:E]  # (E, H) orthonormal type directions
    planted = torch.randperm(I, generator=g).reshape(E, I // E)  # neuron ids of each planted group, scattered
    mlp = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, hidden_act="silu"))
    with torch.no_grad():
        for e, ids in enumerate(planted):
            mlp.gate_proj.weight[ids] = 2 * mu[e] + 0.3 * torch.randn(len(ids), H, generator=g)
            mlp.up_proj.weight[ids] = mu[e] + 0.3 * torch.randn(len(ids), H, generator=g)
        mlp.down_proj.weight.copy_(torch.randn(H, I, generator=g) / I ** 0.5)
    dom = torch.randint(0, E, (N,), generator=g)
    other = (dom + torch.randint(1, E, (N,), generator=g)) % E
    x = 3 * mu[dom] + torch.rand(N, 1, generator=g) * 1.5 * mu[other] + 0.3 * torch.randn(N, H, generator=g)
    return mlp, x, planted


def _true_group_norms(mlp, x, groups):  # written out here, independently of router_fit.group_output_norms
    h = nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)  # (N, I)
    W = mlp.down_proj.weight
    return torch.stack([(h[:, g] @ W[:, g].T).norm(dim=1) for g in groups], 1)  # (N, E)


def test_clustering_recovers_planted_groups():
    mlp, x, planted = _planted_mlp()
    with torch.no_grad():
        h = nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        groups = balanced_kmeans(coactivation_patterns(h, mlp.down_proj.weight), 4, iters=25, seed=0)
    assert sorted(map(sorted, groups.tolist())) == sorted(map(sorted, planted.tolist()))


def test_router_picks_the_largest_groups_far_more_often_than_chance():
    """Margin: with E=4, k=1 chance is 0.25; the fitted router must reach >= 0.25 + 0.6 on its training tokens.
    The same router with its rows paired to the wrong experts (rolled by one) must not: the check can fail."""
    mlp, x, _ = _planted_mlp()
    fit = convert_layer(mlp, x, MoefyConfig(num_experts=4, top_k=1, tokens=len(x)))
    norms = _true_group_norms(mlp, x, fit.groups)
    with torch.no_grad():
        hit = ((x @ fit.router.T).argmax(1) == norms.argmax(1)).double().mean().item()
        hit_mispaired = ((x @ fit.router.roll(1, 0).T).argmax(1) == norms.argmax(1)).double().mean().item()
    assert hit >= 0.25 + 0.6, hit
    assert hit_mispaired < 0.25 + 0.1, hit_mispaired
    assert fit.router_recall == pytest.approx(hit, abs=1e-6)  # the converter's own statistic says the same
    # summing only the router's pick approximates the dense MLP about as well as picking the largest group
    assert fit.rel_error <= fit.oracle_rel_error + 0.05


# ---------------------------------------------------------------- HF round trip
def test_save_load_profile_and_build_drafts(dense, tmp_path):
    conv = moefy(dense, _batches(dense.config.vocab_size), MoefyConfig(num_experts=4, top_k=2, tokens=256))
    conv.model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.specdistill_moefied["num_experts"] == 4
    b = random_batch(dense.config.vocab_size)
    inp = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    with torch.no_grad():
        assert torch.equal(loaded(**inp).logits, conv.model(**inp).logits)
    prof = profile_routing(loaded, [b], "all")
    assert prof.num_experts == 4 and prof.top_k == 2 and prof.layers == [0, 1]
    assert all(sum(c) == prof.tokens * 2 for c in prof.counts)
    b2 = random_batch(dense.config.vocab_size, seed=5)
    both, merged = profile_routing(loaded, [b, b2], "all"), merge_profiles(prof, profile_routing(loaded, [b2], "all"))
    assert both.counts == merged.counts and both.tokens == merged.tokens  # the report's split-half merge
    hot = {s: prof.hot_experts(s, count=2) for s in prof.layers}
    for kind in ("moe", "dense"):
        draft = build_moe_draft(loaded, [0], {0: hot[0]}, kind=kind, profile=prof)
        with torch.no_grad():
            logits = draft(**inp).logits
        assert logits.shape == (*b["input_ids"].shape, dense.config.vocab_size) and torch.isfinite(logits).all()


# ---------------------------------------------------------------- settings and inputs
def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="top-k 3 > --experts 2"):
        MoefyConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="at least 1 active expert"):
        MoefyConfig(num_experts=2, top_k=0)
    with pytest.raises(ValueError, match="at least 1 expert"):
        MoefyConfig(num_experts=0, top_k=1)
    with pytest.raises(ValueError, match=r"does not divide .* 64.*choose one of \[1, 2, 4, 8, 16, 32, 64\]"):
        MoefyConfig(num_experts=3, top_k=1).check_intermediate(64)


def test_models_with_weights_a_mixtral_cannot_hold_are_refused(moe_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(moe_tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"q_proj\.bias.*Llama-family"):
        check_dense_llama(qwen)


def test_realness_metrics():
    assert usage_entropy([1, 1, 1, 1]) == pytest.approx(1.0)
    assert usage_entropy([1, 0, 0, 0]) == pytest.approx(0.0, abs=1e-12)
    assert 0 < usage_entropy([3, 1, 1, 1]) < 1
    assert jaccard([0, 1, 2], [1, 2, 3]) == pytest.approx(0.5)
    assert is_code_like("Here:\n```python\ndef f(x):\n    return x\n```")
    assert not is_code_like("Tell me about the history of Rome, please. What happened in 44 BC?")


# ---------------------------------------------------------------- the command
CODE = "Fix this:\n```python\nimport os\ndef f(x):\n    return x + 1;\n```"


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory, moe_tokenizer):
    d = tmp_path_factory.mktemp("moefy")
    make_tiny_lm(len(moe_tokenizer), layers=2, hidden=32).save_pretrained(d / "target")
    moe_tokenizer.save_pretrained(d / "target")
    rows = conversations(80)
    for r in rows[::3]:  # a third of the conversations show code
        r["conversations"][0]["value"] = CODE
    (d / "conv.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return d


def _cli(d, *extra):
    return ["--target", str(d / "target"), "--data", str(d / "conv.jsonl"), "--out", str(d / "moe"),
            "--cache-dir", str(d / "cache"), "--tokens", "512", "--max-length", "128", "--heldout-size", "8",
            "--subset-tokens", "256", "--recall-tokens", "256", "--threads", "1", *extra]


def test_cli_converts_reports_and_reuses_its_output(cli_inputs, capsys):
    from specdistill.cli.moefy import main

    out = main(_cli(cli_inputs, "--experts", "4", "--top-k", "2"))
    meta = json.loads((out / "moefy.json").read_text())
    rep = json.loads((out / "realness.json").read_text())
    assert (out / "realness.md").exists() and (out / "config.json").exists()
    assert len(rep["layers"]) == 2 and rep["headline"]["heldout_tokens"] > 0
    assert rep["subset_tokens"]["code"] > 0 and rep["subset_tokens"]["chat"] > 0
    assert rep["layers"][0]["code_chat_jaccard"] is not None
    # a random tiny model has little structure, yet the ridge router ranks its groups well above chance (0.5)
    assert all(layer["router_recall"] >= 0.5 + 0.2 for layer in meta["conversion"]["layers"])
    mtime = (out / "moefy.json").stat().st_mtime_ns
    capsys.readouterr()
    main(_cli(cli_inputs, "--experts", "4", "--top-k", "2"))
    assert "reusing it" in capsys.readouterr().out
    assert (out / "moefy.json").stat().st_mtime_ns == mtime
    main(_cli(cli_inputs, "--experts", "4", "--top-k", "1"))  # other settings: rebuilt in place
    assert json.loads((out / "moefy.json").read_text())["inputs"]["settings"]["top_k"] == 1


@pytest.mark.parametrize("args,message", [
    (["--experts", "3", "--top-k", "2"], "does not divide the MLP's intermediate size 64"),
    (["--experts", "4", "--top-k", "5"], "--top-k 5 > --experts 4"),
    (["--experts", "4", "--top-k", "0"], "at least 1 active expert"),
    (["--out", "{d}"], "holds no model: it would be replaced")])
def test_cli_bad_settings(cli_inputs, capsys, args, message):
    from specdistill.cli.moefy import main

    with pytest.raises(SystemExit) as e:  # a later --out wins over _cli's; {d}: the inputs folder itself
        main(_cli(cli_inputs, *[a.format(d=cli_inputs) for a in args]))
    assert e.value.code == 2 and message in capsys.readouterr().err
