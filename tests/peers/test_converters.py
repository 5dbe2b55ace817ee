"""The peer-head converters on synthetic state dicts named as each peer saves them: every tensor lands where our
served layout expects it, aux ids come back in our convention, what the layout cannot hold is named, and the
result passes the vLLM export's own validation with the target's embeddings. No peer is installed."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.peers import arms, converters
from tests.conftest import make_tiny_lm

H, I, NH, NKV, HD, V, VD = 32, 48, 4, 2, 8, 97, 16


def midlayer_parts(g: torch.Generator) -> dict[str, torch.Tensor]:
    shapes = {"input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (NH * HD, 2 * H), "self_attn.k_proj.weight": (NKV * HD, 2 * H),
              "self_attn.v_proj.weight": (NKV * HD, 2 * H), "self_attn.o_proj.weight": (H, NH * HD),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def vocab() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(VD), t2d


def common(g) -> dict[str, torch.Tensor]:
    return {"fc.weight": torch.randn(H, 3 * H, generator=g), "norm.weight": torch.rand(H, generator=g) + 0.5,
            "lm_head.weight": torch.randn(VD, H, generator=g)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = make_tiny_lm(V, layers=4, hidden=H)
    d = tmp_path_factory.mktemp("target")
    model.save_pretrained(d)
    return model, str(d)


def check_lands(conv, mid, com, d2t, t2d):
    sd = conv.state_dict
    for k, v in mid.items():
        assert torch.equal(sd["midlayer." + k], v)
    for k, v in com.items():
        assert torch.equal(sd[k], v)
    assert torch.equal(sd["d2t"], d2t) and torch.equal(sd["t2d"], t2d)


def test_specforge_converts_exactly_and_exports(target, tmp_path):
    g = torch.Generator().manual_seed(0)
    mid, com = midlayer_parts(g), common(g)
    d2t, t2d = vocab()
    sd = {**com, **{"midlayer." + k: v for k, v in mid.items()}, "d2t": d2t, "t2d": t2d,
          "embed_tokens.weight": torch.randn(V, H)}
    conv = converters.convert_specforge(sd, {"vocab_size": V, "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}})
    check_lands(conv, mid, com, d2t, t2d)
    assert conv.exact and conv.aux_layer_ids == [1, 2, 3]  # SGLang counts layer outputs: ours = theirs + 1
    model, path = target
    res = converters.export_converted(conv, model, path, tmp_path / "export")
    from specdistill.drafts.eagle3.export import load_exported, read_checkpoint

    ck = read_checkpoint(res["export"])
    assert torch.equal(ck.state_dict["embed_tokens.weight"], model.get_input_embeddings().weight.detach())
    assert ck.config.aux_layer_ids == [1, 2, 3] and ck.config.intermediate_size == I
    head = load_exported(res["export"])
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, mid["self_attn.q_proj.weight"])


def test_speculators_names_what_the_layout_cannot_hold(target, tmp_path):
    g = torch.Generator().manual_seed(1)
    mid, com = midlayer_parts(g), common(g)
    d2t, t2d = vocab()
    sd = {**com, **{"layers.0." + k: v for k, v in mid.items()}, "d2t": d2t, "t2d": t2d,
          "input_norm.weight": torch.rand(3 * H, generator=g) + 0.5, "embed_tokens.weight": torch.randn(V, H)}
    cfg = {"norm_before_residual": True, "norm_output": True, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
           "transformer_layer_config": {"vocab_size": V}}
    conv = converters.convert_speculators(sd, cfg)
    check_lands(conv, mid, com, d2t, t2d)
    assert conv.aux_layer_ids == [1, 2, 3]  # vLLM's convention already
    assert [x.split(":")[0] for x in conv.inexact] == ["norm_before_fc", "norm_before_residual", "norm_output"]
    exact = converters.convert_speculators({k: v for k, v in sd.items() if k != "input_norm.weight"},
                                           {**cfg, "norm_before_residual": False, "norm_output": False})
    assert exact.exact  # --no-norm-before-residual --no-norm-before-fc --no-norm-output: what our arm trains
    converters.export_converted(exact, target[0], target[1], tmp_path / "export")  # validated on the way


def test_speculators_refuses_more_layers_than_the_layout_holds():
    g = torch.Generator().manual_seed(2)
    sd = {**common(g), **{f"layers.{i}." + k: v for i in (0, 1) for k, v in midlayer_parts(g).items()}}
    with pytest.raises(ValueError, match="one layer"):
        converters.convert_speculators(sd, {})


def test_modelopt_rebuilds_t2d_and_names_its_first_layer_norm(target, tmp_path):
    g = torch.Generator().manual_seed(4)
    mid, com = midlayer_parts(g), common(g)
    d2t, t2d = vocab()
    p = "eagle_module."
    sd = {**{p + k: v for k, v in com.items()}, **{p + "layers.0." + k: v for k, v in mid.items()}, p + "d2t": d2t,
          "lm_head.weight": torch.randn(V, H)}  # the base model's own tensors are not the head's
    conv = converters.convert_modelopt(sd, {"vocab_size": V, "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                                            "use_input_layernorm_in_first_layer": True})
    check_lands(conv, mid, com, d2t, t2d)  # t2d rebuilt from the offsets
    assert conv.aux_layer_ids == [1, 2, 3]
    assert len(conv.inexact) == 1 and conv.inexact[0].startswith("input_layernorm before hidden_norm")
    converters.export_converted(conv, target[0], target[1], tmp_path / "export")


def test_norm_spread_is_zero_for_a_constant_gain():
    assert converters._norm_spread(torch.full((8,), 0.7)) == pytest.approx(0.0, abs=1e-6)
    assert converters._norm_spread(torch.tensor([1.0, 2.0])) == pytest.approx(1 / 3)


def test_aux_conventions_round_trip():
    for peer in arms.PEERS:
        ours = (2, 15, 27)
        assert arms.our_aux_ids(peer, arms.peer_aux_ids(peer, ours)) == list(ours)
    assert arms.peer_aux_ids("specforge", (2, 15, 27)) == [1, 14, 26]
    assert arms.peer_aux_ids("speculators", (2, 15, 27)) == [2, 15, 27]


def test_every_arm_shares_the_head_and_ours_uses_our_settings():
    for peer in arms.PEERS:
        ours = arms.settings_for(peer, "ours")
        assert (ours.ttt_steps, ours.step_decay, ours.lr) == (arms.OURS.ttt_steps, arms.OURS.step_decay, arms.OURS.lr)
        assert arms.arm_record(peer, "defaults", arms.HeadShape())["shape"]["draft_vocab_size"] == 8192
    with pytest.raises(ValueError, match="kinds"):
        arms.settings_for("speculators", "best")


def test_one_row_arm_differs_from_ours_only_in_rows_per_step():
    for peer in arms.PEERS:
        one, ours = arms.settings_for(peer, "ours-1row"), arms.settings_for(peer, "ours")
        assert one.rows_per_step == 1 and ours.rows_per_step == arms.OURS.rows_per_step > 1
        assert replace(one, rows_per_step=ours.rows_per_step) == ours
    assert set(arms.DEFAULT_ARM_KINDS) < set(arms.ARM_KINDS)


def test_install_record_is_reused_and_a_changed_spec_rebuilds(tmp_path, monkeypatch):
    import json

    from benchmarks.peers import install

    monkeypatch.setenv("SPECDISTILL_PEERS_DIR", str(tmp_path))
    py = install.venv_python("specforge")
    py.parent.mkdir(parents=True)
    py.touch()
    assert not install.is_installed("specforge")  # no record: the venv is rebuilt
    (tmp_path / "specforge" / "installed.json").write_text(json.dumps(install._record(install.PEERS["specforge"])))
    assert install.is_installed("specforge")  # the record as JSON reads it back matches: reused
    monkeypatch.setitem(install.PEERS, "specforge", install.PeerSpec("specforge", "specforge==0.2.1", deps=()))
    assert not install.is_installed("specforge")
