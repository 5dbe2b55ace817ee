"""EAGLE-3 export: both formats reload to identical logits; validation refuses broken heads and writes nothing."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.drafts.eagle3.export import (ExportResult, expected_tensors, export_eagle3, load_exported,
                                              read_checkpoint, validate_export)
from specdistill.drafts.eagle3.model import Eagle3Head, build_eagle3
from tests.conftest import make_tiny_lm

V, H, L, MAX_POS = 97, 32, 4, 777


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("export_target")
    make_tiny_lm(V, layers=L, hidden=H, seed=1, max_pos=MAX_POS).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def head():
    target = make_tiny_lm(V, layers=L, hidden=H, seed=1, max_pos=MAX_POS)
    torch.manual_seed(0)
    h = build_eagle3(target, torch.randperm(V)[:40].sort().values, [1, 2, 3])
    h.config.max_position_embeddings = 2048  # as if trained with a default: the export must take the target's
    for p in h.parameters():  # fresh norms are all ones: make every tensor matter
        if p.requires_grad:
            p.data.add_(0.05 * torch.randn_like(p))
    return h.eval()


@pytest.fixture
def head_dir(head, tmp_path):
    head.save_pretrained(tmp_path / "head")
    return tmp_path / "head"


def _logits(h: Eagle3Head) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 7, 3 * H, generator=g)
    ids = torch.randint(0, V, (2, 7), generator=g)
    with torch.no_grad():
        return torch.stack(h(aux, ids, torch.ones_like(ids), steps=3))


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_export_reload_gives_identical_logits(head, head_dir, target_dir, tmp_path, fmt):
    out = tmp_path / f"out_{fmt}"
    res = export_eagle3(head_dir, out, fmt=fmt, target_path=str(target_dir), speculative_tokens=4)
    assert isinstance(res, ExportResult) and res.out_dir == out and res.format == fmt
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))  # engines reuse the target's
    reloaded = load_exported(out, embeddings=head.embed_tokens.weight)
    if fmt != "speculators":  # midlayer exports are what the training code itself loads
        reloaded_native = Eagle3Head.from_pretrained(out)
        reloaded_native.embed_tokens.weight.data.copy_(head.embed_tokens.weight)
        assert torch.equal(_logits(reloaded_native), _logits(head))
    assert torch.equal(_logits(reloaded), _logits(head))
    assert torch.equal(reloaded.d2t, head.d2t) and torch.equal(reloaded.t2d, head.t2d)


def test_midlayer_config_and_names(head_dir, target_dir, tmp_path):
    export_eagle3(head_dir, tmp_path / "o", target_path=str(target_dir))
    c = json.loads((tmp_path / "o" / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
    assert c["max_position_embeddings"] == MAX_POS  # the target's, not the head's 2048
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and c["norm_before_residual"] is False
    assert (c["draft_vocab_size"], c["vocab_size"], c["target_hidden_size"]) == (40, V, H)
    assert c["tie_word_embeddings"] is False
    names = set(load_file(str(tmp_path / "o" / "model.safetensors")))
    assert names == set(expected_tensors(read_checkpoint(tmp_path / "o").config))


def test_speculators_config_and_names(head_dir, target_dir, tmp_path):
    export_eagle3(head_dir, tmp_path / "s", fmt="speculators", target_path=str(target_dir), speculative_tokens=5,
                  include_embeddings=True, verifier_name="org/target")
    c = json.loads((tmp_path / "s" / "config.json").read_text())
    assert c["architectures"] == ["Eagle3Speculator"] and c["speculators_model_type"] == "eagle3"
    assert c["norm_before_residual"] is False and c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert c["transformer_layer_config"]["max_position_embeddings"] == MAX_POS
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert c["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    names = set(load_file(str(tmp_path / "s" / "model.safetensors")))
    assert "layers.0.mlp.down_proj.weight" in names and "embed_tokens.weight" in names
    assert not any(n.startswith("midlayer.") for n in names)
    assert validate_export(tmp_path / "s").format == "speculators"


def test_sglang_writes_ids_in_sglangs_convention(head_dir, target_dir, tmp_path):
    """SGLang serves config id j with the stream after j + 1 layers: ids are written minus one, and read back."""
    res = export_eagle3(head_dir, tmp_path / "g", fmt="sglang", target_path=str(target_dir))
    c = json.loads((tmp_path / "g" / "config.json").read_text())
    assert c["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and c["aux_layer_convention"] == "sglang"
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert read_checkpoint(tmp_path / "g").config.aux_layer_ids == [1, 2, 3] and res.format == "sglang"
    assert Eagle3Head.from_pretrained(tmp_path / "g").config.aux_layer_ids == [1, 2, 3]


def test_sglang_refuses_the_embeddings_layer(head_dir, target_dir, tmp_path):
    c = json.loads((head_dir / "config.json").read_text())
    c["eagle_aux_hidden_state_layer_ids"] = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]
    (head_dir / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="cannot be expressed in SGLang"):
        export_eagle3(head_dir, tmp_path / "g", fmt="sglang", target_path=str(target_dir))
    export_eagle3(head_dir, tmp_path / "v", fmt="vllm", target_path=str(target_dir))  # fine for vLLM


def _edit(head_dir, fn):
    f = head_dir / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f))


def _shift_first(sd):  # draft id 0 now maps where draft id 1 does: not increasing, and t2d disagrees
    sd["d2t"][0] = sd["d2t"][1] + 1


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("midlayer.mlp.down_proj.weight"), "missing tensor midlayer.mlp.down_proj.weight"),
    (lambda sd: sd.pop("d2t"), "missing tensor d2t"),
    (lambda sd: sd.pop("lm_head.weight"), "missing tensor lm_head.weight"),
    (lambda sd: sd.update({"midlayer.self_attn.q_proj.weight": torch.zeros(32, 32)}),
     "midlayer.self_attn.q_proj.weight has shape [32, 32], expected [32, 64]"),
    (lambda sd: sd.update({"fc.weight": torch.zeros(H, 2 * H)}), "fc.weight has shape"),
    (lambda sd: sd.update({"midlayer.extra.weight": torch.zeros(3)}), "unknown tensor midlayer.extra.weight"),
    (lambda sd: sd.update({"d2t": sd["d2t"] + V}), "outside the target vocab"),
    (_shift_first, "not strictly increasing"),
    (lambda sd: sd["t2d"].__setitem__(int(torch.nonzero(~sd["t2d"])[0]), True), "t2d does not match d2t"),
    (lambda sd: sd.update({"d2t": sd["d2t"].int()}), "tensor d2t has dtype torch.int32"),
    (lambda sd: sd["norm.weight"].__setitem__(0, float("nan")), "NaN"),
])
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_validation_rejects_and_writes_nothing(head_dir, target_dir, tmp_path, edit, message, fmt):
    _edit(head_dir, edit)
    out = tmp_path / "exported"
    with pytest.raises(ValueError, match="nothing was written") as e:
        export_eagle3(head_dir, out, fmt=fmt, target_path=str(target_dir))
    assert message in str(e.value)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["head"]  # no temp debris either


def test_rejects_every_problem_at_once(head_dir, target_dir, tmp_path):
    _edit(head_dir, lambda sd: (sd.pop("midlayer.mlp.down_proj.weight"), sd.pop("lm_head.weight")))
    with pytest.raises(ValueError) as e:
        export_eagle3(head_dir, tmp_path / "o", target_path=str(target_dir))
    assert "down_proj" in str(e.value) and "lm_head" in str(e.value)


def test_aux_ids_out_of_range_for_the_target(head_dir, target_dir, tmp_path):
    c = json.loads((head_dir / "config.json").read_text())
    c["eagle_aux_hidden_state_layer_ids"] = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, L]
    (head_dir / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=rf"\[{L}\] out of range for a target with {L} layers"):
        export_eagle3(head_dir, tmp_path / "o", target_path=str(target_dir))
    assert not (tmp_path / "o").exists()


def test_unsorted_aux_ids_are_rewritten_exactly(head, head_dir, target_dir, tmp_path):
    """A head trained with aux ids (3, 1, 2) reads fc blocks in that order; engines concatenate in layer order."""
    c = json.loads((head_dir / "config.json").read_text())
    c["eagle_aux_hidden_state_layer_ids"] = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 1, 2]
    (head_dir / "config.json").write_text(json.dumps(c))
    res = export_eagle3(head_dir, tmp_path / "o", target_path=str(target_dir))
    assert res.config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and any("reordered" in w for w in res.warnings)
    fc_in, fc_out = head.fc.weight, load_exported(tmp_path / "o").fc.weight
    feats = torch.randn(5, 3, H)  # features of layers 1, 2, 3
    trained_order = feats[:, [2, 0, 1]].reshape(5, -1)  # what the head saw in training: (3, 1, 2)
    assert torch.allclose(trained_order @ fc_in.T, feats.reshape(5, -1) @ fc_out.T, atol=1e-6)


def test_target_mismatch_is_refused(head_dir, tmp_path):
    other = tmp_path / "other_target"
    make_tiny_lm(V + 3, layers=L, hidden=H).save_pretrained(other)
    with pytest.raises(ValueError, match="vocab_size"):
        export_eagle3(head_dir, tmp_path / "o", target_path=str(other))


def test_existing_out_dir_is_kept_unless_overwrite(head_dir, target_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        export_eagle3(head_dir, out, target_path=str(target_dir))
    assert (out / "keep.txt").exists()
    export_eagle3(head_dir, out, target_path=str(target_dir), overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_validate_export_catches_a_tampered_export(head_dir, target_dir, tmp_path):
    out = tmp_path / "o"
    export_eagle3(head_dir, out, target_path=str(target_dir))
    validate_export(out, target_path=str(target_dir))
    _edit(out, lambda sd: sd.pop("midlayer.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match="down_proj"):
        validate_export(out)


def test_cli(head_dir, target_dir, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "export.py"
    spec = importlib.util.spec_from_file_location("export_cli", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--draft", str(head_dir), "--format", "speculators", "--target", str(target_dir),
                     "--out", str(tmp_path / "cli")]) == 0
    assert "layers.0.mlp.down_proj.weight" in capsys.readouterr().out and (tmp_path / "cli" / "config.json").exists()
    assert cli.main(["--check", str(tmp_path / "cli"), "--target", str(target_dir)]) == 0
    _edit(head_dir, lambda sd: sd.pop("lm_head.weight"))
    assert cli.main(["--draft", str(head_dir), "--out", str(tmp_path / "cli2")]) == 2
    assert "missing tensor lm_head.weight" in capsys.readouterr().err and not (tmp_path / "cli2").exists()


def test_a_full_vocabulary_heads_vllm_export_has_no_vocab_maps(target_dir, tmp_path):
    """vLLM 0.32 refuses a d2t for a head whose draft vocabulary is the target's: the vLLM export leaves the maps out,
    validates, and reloads to the same logits (the identity maps stand); other formats keep them."""
    target = make_tiny_lm(V, layers=L, hidden=H, seed=1, max_pos=MAX_POS)
    torch.manual_seed(0)
    full = build_eagle3(target, torch.arange(V), [1, 2, 3]).eval()
    full.save_pretrained(tmp_path / "full")
    for fmt, has_maps in (("vllm", False), ("sglang", True)):
        out = tmp_path / f"full_{fmt}"
        export_eagle3(tmp_path / "full", out, fmt=fmt, target_path=str(target_dir), speculative_tokens=4)
        names = set(load_file(str(out / "model.safetensors")))
        assert ({"d2t", "t2d"} <= names) == has_maps and not ({"d2t", "t2d"} & names and not has_maps)
        validate_export(out)
        reloaded = load_exported(out, embeddings=full.embed_tokens.weight)
        assert torch.equal(_logits(reloaded), _logits(full))
        assert torch.equal(reloaded.d2t, full.d2t) and torch.equal(reloaded.t2d, full.t2d)
