"""Training and export on every architecture of tests/tiny_archs.py: one kd step (an LM draft from the target's first
layer) and one eagle3 step (a head over aux layers up to L-1) train only the draft; the vLLM export reloads to the
trained head's logits. Gemma-3: the head embeds exactly as the target (sqrt(hidden) scale), stored features rebuild the
soft-capped logits the model emits, the final norm's (1 + w) gain is copied; a 262k vocabulary stays cheap."""
import json

import pytest
import torch

from specdistill.config import DraftConfig
from specdistill.drafts.lm import build_draft
from specdistill.drafts.eagle3.export import export_eagle3, load_exported
from specdistill.drafts.eagle3.model import build_eagle3
from specdistill.models.vocab import frequent_token_vocab
from specdistill.models.target import Target
from specdistill.objectives.base import Models
from specdistill.objectives.eagle3 import Eagle3Objective
from specdistill.objectives.kd import KDObjective
from tests.conftest import single_thread
from tests.tiny_archs import ARCHITECTURES, tiny_target

AUX = [1, 2, 3]  # low / middle / last stream (L - 1) of a 4-layer target
VD = 96  # draft vocabulary: a third of the tiny vocabulary, so restriction and masking are exercised

_single_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def four_layers(arch: str, **overrides) -> torch.nn.Module:
    if arch == "gemma3":  # sliding layers around full ones, as the factory's, one deeper
        overrides.setdefault("layer_types", ["sliding_attention", "full_attention"] * 2)
    return tiny_target(arch, seed=3, num_hidden_layers=4, **overrides)


def batch_for(model, B: int = 2, T: int = 14, seed: int = 0) -> dict:
    """Right-padded random ids, loss on the second half of each row."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    ids = torch.randint(3, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, T - 3:] = 0
    ids[1, T - 3:] = 0
    lm = torch.zeros(B, T, dtype=torch.long)
    lm[:, T // 2: -1] = 1
    lm[1, T - 4:] = 0
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def head_for(model, batch, aux=AUX, vd=VD, output_from_target=False):
    """A head whose draft vocabulary holds the target's own next tokens on `batch` first (as data-frequency
    selection on regenerated data would), so most loss positions are in vocabulary."""
    with torch.no_grad():
        greedy = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    rows = [{"input_ids": [0] + r.tolist(), "loss_mask": [1] * (len(r) + 1)} for r in greedy]
    vocab = frequent_token_vocab(rows, model.config.vocab_size, vd)
    return build_eagle3(model, vocab, aux, output_from_target=output_from_target)


def assert_only_draft_learns(draft, target: Target):
    trainable = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    assert trainable
    for n, p in trainable:
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert sum(float(p.grad.norm()) for _, p in trainable) > 0
    assert all(not p.requires_grad and p.grad is None for p in target.parameters())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_kd_step_trains_the_lm_draft_only(arch):
    model = four_layers(arch)
    target = Target(model)
    draft = build_draft(DraftConfig(init="from_target", num_layers=1), model)
    batch = batch_for(model)
    out = KDObjective()(batch, Models(draft, target))
    assert out.loss.shape == (int(batch["loss_mask"].sum()),) and torch.isfinite(out.loss).all()
    out.loss.mean().backward()
    assert_only_draft_learns(draft, target)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eagle3_step_and_vllm_export_round_trip(arch, tmp_path):
    model = four_layers(arch)
    batch = batch_for(model)
    head = head_for(model, batch)
    target = Target(model, head.config.aux_layer_ids)
    assert head.config.aux_layer_ids == AUX and head.config.hidden_act == "silu"
    out = Eagle3Objective(steps=3)(batch, Models(head, target))
    # finite, and not all masked: some of the target's argmaxes are in the draft vocabulary
    assert torch.isfinite(out.loss).all() and float(out.loss.detach().sum()) > 0
    (out.loss * out.weight).sum().backward()
    assert_only_draft_learns(head, target)
    assert head.embed_tokens.weight.grad is None  # the target's embeddings stay frozen in the head
    torch.optim.SGD([p for p in head.parameters() if p.requires_grad], lr=0.5).step()  # a head unlike its init

    model.save_pretrained(tmp_path / "target")
    head.save_pretrained(tmp_path / "head")
    res = export_eagle3(tmp_path / "head", tmp_path / "vllm", fmt="vllm", target_path=str(tmp_path / "target"))
    served = load_exported(tmp_path / "vllm", embeddings=model.get_input_embeddings().weight.detach())
    aux = target(batch["input_ids"], batch["attention_mask"]).aux_hidden
    with torch.no_grad():
        want = head(aux, batch["input_ids"], batch["attention_mask"], steps=2)
        got = served(aux, batch["input_ids"], batch["attention_mask"], steps=2)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    if arch not in ("llama", "qwen2", "qwen3", "qwen3_moe"):  # model types vLLM does not accept as EAGLE-3 targets
        assert any("eagle3_target_supported" in w for w in res.warnings)


def test_gemma3_head_embeds_as_the_target_and_the_vllm_export_carries_the_scale(tmp_path):
    model = four_layers("gemma3")
    batch = batch_for(model)
    head = head_for(model, batch)
    ids = batch["input_ids"]
    assert head.config.embed_scale == pytest.approx(32 ** 0.5, rel=1e-6)  # sqrt(hidden)
    torch.testing.assert_close(head.embed(ids), model.get_input_embeddings()(ids), rtol=0, atol=0)
    head.save_pretrained(tmp_path / "head")
    model.save_pretrained(tmp_path / "target")
    export_eagle3(tmp_path / "head", tmp_path / "vllm", fmt="vllm", target_path=str(tmp_path / "target"))
    # vLLM keeps a head's own embed_tokens when they differ from the target's: written pre-scaled, with no scale field
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    from safetensors.torch import load_file

    emb = load_file(str(tmp_path / "vllm" / "model.safetensors"))["embed_tokens.weight"]
    assert "embed_scale" not in cfg
    torch.testing.assert_close(emb[ids], model.get_input_embeddings()(ids), rtol=0, atol=0)
    # SGLang replaces a head's embeddings with the target's unscaled weight: kept as a config field for specdistill,
    # and allowed because the head's input_layernorm makes the difference an eps change (tiny here) ...
    res = export_eagle3(tmp_path / "head", tmp_path / "sglang", fmt="sglang", target_path=str(tmp_path / "target"))
    assert any("SGLang drops the head's embedding scale" in w for w in res.warnings)
    served = load_exported(tmp_path / "sglang", embeddings=model.get_input_embeddings().weight.detach())
    torch.testing.assert_close(served.embed(ids), head.embed(ids))
    # ... but refused when it is not (embedding rows so small that eps dominates their RMS)
    with torch.no_grad():
        head.embed_tokens.weight.mul_(1e-4)
    head.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="SGLang feeds EAGLE-3 heads the target's unscaled embedding"):
        export_eagle3(tmp_path / "small", tmp_path / "sglang2", fmt="sglang", target_path=str(tmp_path / "target"))
    assert not (tmp_path / "sglang2").exists()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_stored_features_rebuild_the_logits_the_model_emits(arch):
    """Offline / regenerated training rebuilds logits from the final hidden state: soft cap included (Gemma)."""
    model = four_layers(arch)
    batch = batch_for(model)
    target = Target(model)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    final = out.hidden_states[-1]
    torch.testing.assert_close(target.from_features(final).logits, out.logits, rtol=1e-5, atol=1e-5)
    head = head_for(model, batch)
    pos = batch["loss_mask"].bool()
    feats = {**batch, "final_hidden": final, "target_argmax": out.logits.argmax(-1)}
    got = target.draft_vocab_outputs(feats, pos, head.t2d)
    torch.testing.assert_close(got.logits, out.logits[pos][:, head.t2d], rtol=1e-5, atol=1e-5)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        assert out.logits.abs().max() < cap
        assert not torch.allclose(model.get_output_embeddings()(final), out.logits)  # the cap is really applied


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_output_from_target_starts_the_head_as_the_targets_logit_lens(arch):
    """The head's readout(h) = lm_head(norm(h)) equals the target's own (uncapped) readout on the draft vocabulary,
    whatever the norm's parametrisation (Gemma computes (1 + weight) * x / rms)."""
    model = four_layers(arch)
    with torch.no_grad():
        model.model.norm.weight.copy_(0.3 * torch.randn_like(model.model.norm.weight))
    batch = batch_for(model)
    head = head_for(model, batch, output_from_target=True)
    h = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        want = model.get_output_embeddings()(model.model.norm(h))[:, head.t2d]
        torch.testing.assert_close(head.readout(h), want, rtol=1e-5, atol=1e-5)


def test_large_vocabulary_head_and_draft_vocab_stay_cheap():
    """Gemma-3's 262k vocabulary: frequency selection keeps O(V) counts, the head trains one step."""
    V = 262_144
    g = torch.Generator().manual_seed(0)
    hot = torch.randint(0, V, (500,), generator=g)
    rows = [{"input_ids": hot[torch.randint(0, 500, (64,), generator=g)].tolist(), "loss_mask": [1] * 64}
            for _ in range(40)]
    vocab = frequent_token_vocab(rows, V, 1024)
    assert len(vocab) == 1024 and bool((vocab[1:] > vocab[:-1]).all())
    predicted = {t for r in rows for t in r["input_ids"][1:]}  # loss_mask[t] counts token t + 1
    assert predicted <= set(vocab.tolist())  # every predicted token is kept (<= 500 of them, Vd = 1024)
    # with a draft vocabulary smaller than the tokens seen, the most frequent ones win
    counts = torch.bincount(torch.tensor([t for r in rows for t in r["input_ids"][1:]]), minlength=V)
    small = frequent_token_vocab(rows, V, 50)
    assert int(counts[small].min()) >= int(counts[~torch.isin(torch.arange(V), small)].max())
    model = four_layers("gemma3", vocab_size=V)
    batch = batch_for(model, T=10)
    head = build_eagle3(model, vocab, AUX)
    out = Eagle3Objective(steps=2)(batch, Models(head, Target(model, AUX)))
    assert head.lm_head.weight.shape == (1024, 32) and torch.isfinite(out.loss).all()
