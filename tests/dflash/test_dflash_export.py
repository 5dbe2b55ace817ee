"""Export to vLLM's DFlash layout: an independent forward written from the exported files alone (config keys and tensor
names as vLLM's qwen3_dflash model reads them: fused qkv, context K/V precomputed from hidden_norm(fc(features)) with
K-norm and neox RoPE, the target's embedding and LM head) gives the draft's logits to 1e-5; bad pairs are refused."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdistill.drafts.dflash.export import expected_tensors, export_dflash
from tests.dflash.conftest import tiny_dflash, tiny_target


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _neox(x, pos, theta):  # x (S, h, hd), pos (S,)
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    f = pos.float()[:, None] * inv                                     # (S, hd/2)
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@torch.no_grad()
def _vllm_layout_logits(folder, target, hidden_states, anchor: int, anchor_pos: int) -> torch.Tensor:
    """Block logits (B-1, V) computed from the export folder only, in vLLM's order of operations."""
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    eps, theta, hd = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]
    nh, nkv, B = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["block_size"]
    layers = cfg["eagle_aux_hidden_state_layer_ids"]
    assert layers == [l + 1 for l in cfg["dflash_config"]["target_layer_ids"]]
    # context: combine_hidden_states (fc), then hidden_norm and every layer's fused K/V projection, K-norm, RoPE
    ctx = torch.cat([hidden_states[k][0, :anchor_pos] for k in layers], -1) @ w["fc.weight"].T    # (S, H)
    ctx = _rms(ctx, w["hidden_norm.weight"], eps)
    S = ctx.shape[0]
    ctx_pos = torch.arange(S)
    x = target.get_input_embeddings().weight[torch.tensor([anchor] + [cfg["dflash_config"]["mask_token_id"]] * (B - 1))]
    pos = anchor_pos + torch.arange(B)
    residual = None
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        qkv_w = torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                           w[p + "self_attn.v_proj.weight"]])                                       # QKVParallelLinear
        kv_w = qkv_w[nh * hd:]
        kv = ctx @ kv_w.T
        k_ctx = _neox(_rms(kv[:, : nkv * hd].view(S, nkv, hd), w[p + "self_attn.k_norm.weight"], eps), ctx_pos, theta)
        v_ctx = kv[:, nkv * hd:].view(S, nkv, hd)
        residual = x if residual is None else x + residual
        h = _rms(residual, w[p + "input_layernorm.weight"], eps)
        q, k, v = (h @ qkv_w.T).split([nh * hd, nkv * hd, nkv * hd], -1)
        q = _neox(_rms(q.view(B, nh, hd), w[p + "self_attn.q_norm.weight"], eps), pos, theta)
        k = _neox(_rms(k.view(B, nkv, hd), w[p + "self_attn.k_norm.weight"], eps), pos, theta)
        K = torch.cat([k_ctx, k]).repeat_interleave(nh // nkv, 1).transpose(0, 1)                  # (nh, S+B, hd)
        Vv = torch.cat([v_ctx, v.view(B, nkv, hd)]).repeat_interleave(nh // nkv, 1).transpose(0, 1)
        att = ((q.transpose(0, 1) @ K.transpose(1, 2)) * hd ** -0.5).softmax(-1) @ Vv              # non-causal
        x = att.transpose(0, 1).reshape(B, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        residual = x + residual
        h = _rms(residual, w[p + "post_attention_layernorm.weight"], eps)
        gate_up = h @ torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).T
        g, u = gate_up.chunk(2, -1)
        x = (F.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    h = _rms(x + residual, w["norm.weight"], eps)
    if "d2t" not in w:  # the target's LM head
        return (h @ target.get_output_embeddings().weight.T)[1:]
    # compute_logits with a draft vocabulary: its own LM head rows, placed at base + d2t, -inf elsewhere
    logits = torch.full((B, cfg["vocab_size"]), float("-inf"))
    logits[:, torch.arange(cfg["draft_vocab_size"]) + w["d2t"]] = h @ w["lm_head.weight"].T
    return logits[1:]


@pytest.mark.parametrize("vd", [None, 20])
def test_export_round_trip_to_vllms_layout(vd, tmp_path):
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    draft = tiny_dflash(target, 4, num_layers=2, vocab=None if vd is None else torch.arange(5, 45, 2))
    draft.save_pretrained(tmp_path / "draft")
    res = export_dflash(tmp_path / "draft", tmp_path / "out", target_path=str(tmp_path / "target"))
    names = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert names == set(expected_tensors(draft.config)) and ("lm_head.weight" in names) == (vd is not None)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4 and res.config == cfg
    assert cfg["draft_vocab_size"] == (vd or 48)
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    ids = torch.randint(3, 48, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[k] for k in draft.config.aux_layer_ids], -1)
        for a in (1, 7, 13):
            q = draft.logits(draft(feats, torch.ones(1, 14, dtype=torch.bool), ids[:, a: a + 1],
                                   torch.tensor([[a]]))[0, 0, 1:])                  # (B-1, Vd)
            ours = torch.full((3, 48), float("-inf"))
            ours[:, draft.draft_to_target(torch.arange(q.shape[-1]))] = q
            torch.testing.assert_close(_vllm_layout_logits(tmp_path / "out", target, hs, int(ids[0, a]), a), ours,
                                       atol=1e-5, rtol=1e-5)


def test_export_refuses_another_target_and_existing_folders(tmp_path):
    target = tiny_target()
    draft = tiny_dflash(target, 4)
    draft.save_pretrained(tmp_path / "draft")
    tiny_target(layers=6).save_pretrained(tmp_path / "deeper")
    with pytest.raises(ValueError, match="layers"):
        export_dflash(tmp_path / "draft", tmp_path / "out", target_path=str(tmp_path / "deeper"))
    with pytest.raises(ValueError, match="DFlash"):
        export_dflash(tmp_path / "draft", tmp_path / "out", fmt="sglang")
    export_dflash(tmp_path / "draft", tmp_path / "out")
    with pytest.raises(FileExistsError):
        export_dflash(tmp_path / "draft", tmp_path / "out")


def test_the_export_cli_writes_the_saved_kinds_layout(tmp_path):
    from specdistill.cli.export import main

    draft = tiny_dflash(tiny_target(), 4)
    draft.save_pretrained(tmp_path / "draft")
    assert main(["--draft", str(tmp_path / "draft"), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_the_export_cli_checks_a_dflash_export_with_its_own_validation(tmp_path, capsys):
    """--check asks the kind that wrote the export (its config.json's architectures): a DFlash export is validated as
    DFlash, against --target's depth, and a broken one is refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    from specdistill.cli.export import main

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    tiny_target(layers=6).save_pretrained(tmp_path / "deeper")
    tiny_dflash(target, 4).save_pretrained(tmp_path / "draft")
    export_dflash(tmp_path / "draft", tmp_path / "out")
    assert main(["--check", str(tmp_path / "out"), "--target", str(tmp_path / "target")]) == 0
    assert "is a valid vllm dflash export" in capsys.readouterr().out
    assert main(["--check", str(tmp_path / "out"), "--target", str(tmp_path / "deeper")]) == 2
    assert "layers" in capsys.readouterr().err
    weights = tmp_path / "out" / "model.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if k != "fc.weight"}, str(weights))
    assert main(["--check", str(tmp_path / "out")]) == 2
    assert "missing tensor fc.weight" in capsys.readouterr().err
