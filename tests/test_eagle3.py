"""EAGLE-3 head: the TTT unroll equals a naive step-by-step reference, vocab maps round-trip, persistence, errors."""
import pytest
import torch

from specdistill.drafts.eagle3.model import Eagle3Head, SlotCache, build_eagle3, default_aux_layer_ids
from specdistill.models.vocab import frequent_token_vocab
from specdistill.models.target import Target
from specdistill.objectives.eagle3 import Eagle3Objective, draft_vocab_targets
from specdistill.objectives.base import Models
from tests.conftest import make_tiny_lm, noisy_eagle3_head

V = 97


@pytest.fixture(scope="module")
def target():
    return make_tiny_lm(V, layers=4, hidden=32, seed=1).eval()


def _head(target, vd=V, seed=0):
    return noisy_eagle3_head(target, vd, seed).eval()


def test_ttt_unroll_equals_naive_step_by_step_inference(target):
    head = _head(target)
    B, T, steps = 2, 9, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 7:] = 0  # right padding
    aux = torch.randn(B, T, 3 * 32, generator=g)
    with torch.no_grad():
        ttt = head(aux, ids, am, steps=steps)
        fused = head.fc(aux)
        for b in range(B):
            n = int(am[b].sum())
            # step 0 over the valid prefix, as inference prefills the accepted context
            pos = torch.arange(n)[None]
            out0 = head.step(torch.roll(ids[b:b + 1, :n], -1, 1), fused[b:b + 1, :n], pos)
            assert torch.allclose(out0.logits[0, : n - 1], ttt[0][b, : n - 1], atol=1e-5)
            for t in range(n - steps):
                # draft deeper from slot t: cache = step-0 keys of slots <= t, then each own step's key
                past = (out0.keys[:, :, : t + 1], out0.values[:, :, : t + 1])
                h = out0.hidden[:, t: t + 1]
                for j in range(1, steps):
                    o = head.step(ids[b:b + 1, t + 1 + j: t + 2 + j], h, torch.tensor([[t + j]]), past)
                    assert torch.allclose(o.logits[0, 0], ttt[j][b, t], atol=1e-5), (b, t, j)
                    past, h = (o.keys, o.values), o.hidden


def test_slot_cache_steps_equal_concatenated_steps_through_growth_crops_and_selects(target):
    """Steps appended in place (capacity 2, so it grows several times), cropped and column-selected as a drafter
    does, give the logits and keys of steps whose cache is rebuilt by concatenation."""
    head = _head(target)
    B, H = 2, head.config.hidden_size
    g = torch.Generator().manual_seed(3)
    cache = SlotCache(B, head.config.num_attention_heads, head.config.head_dim, "cpu", torch.float32, capacity=2)
    past, pos = None, 0
    with torch.no_grad():
        for n, keep in [(5, 3), (1, 1), (4, 2), (2, 2), (3, 0)]:  # append n slots, then keep the first `keep`
            ids = torch.randint(0, V, (B, n), generator=g)
            feat = torch.randn(B, n, H, generator=g)
            positions = torch.arange(pos, pos + n)[None].expand(B, -1)
            ref = head.step(ids, feat, positions, past)
            out = head.step(ids, feat, positions, cache)
            assert torch.allclose(out.logits, ref.logits, atol=1e-6)
            assert torch.equal(out.keys, ref.keys) and torch.equal(out.values, ref.values)
            S = ref.keys.shape[2] - n + keep
            past = (ref.keys[:, :, :S], ref.values[:, :, :S])
            cache.crop(S)
            pos += keep
        assert cache.keys.shape[2] >= 8  # grew from 2
        columns = torch.tensor([[0, 2, 5], [1, 3, 4]])                  # a compaction: each row keeps its own columns
        cache.select(columns)
        idx = columns[:, None, :, None].expand(-1, past[0].shape[1], -1, past[0].shape[-1])
        keys, values = cache.view()
        assert torch.equal(keys, past[0].gather(2, idx)) and torch.equal(values, past[1].gather(2, idx))


def test_vocab_maps_round_trip(target):
    head = _head(target, vd=40)
    kept = torch.nonzero(head.t2d).squeeze(-1)
    assert len(kept) == 40 and head.t2d.sum() == 40
    draft_ids = torch.arange(40)
    assert torch.equal(head.draft_to_target(draft_ids), kept)  # d2t offsets map draft ids onto the kept target ids
    assert (head.d2t >= 0).all()
    # restricted, renormalised target probs
    p_logits = torch.randn(5, V)
    p, in_vocab = draft_vocab_targets(p_logits, head.t2d)
    assert torch.allclose(p.sum(-1), torch.ones(5), atol=1e-5)
    kept = p_logits.softmax(-1)[:, head.t2d]
    assert torch.allclose(p, kept / kept.sum(-1, keepdim=True))
    assert torch.equal(in_vocab, head.t2d[p_logits.argmax(-1)])


def test_frequent_vocab_picks_the_most_frequent_loss_tokens():
    rows = [{"input_ids": [0, 5, 5, 7, 9, 9, 9], "loss_mask": [1, 1, 1, 1, 1, 0, 0]}]  # predicts 5, 5, 7, 9, 9
    assert frequent_token_vocab(rows, 12, 2).tolist() == [5, 9]
    assert frequent_token_vocab(rows, 12, 3).tolist() == [5, 7, 9]
    assert len(frequent_token_vocab(rows, 12, 50)) == 12


def test_save_and_reload_gives_identical_logits(target, tmp_path):
    head = _head(target, vd=50)
    head.save_pretrained(tmp_path / "h")
    again = Eagle3Head.from_pretrained(tmp_path / "h").eval()
    ids = torch.randint(0, V, (1, 6))
    aux = torch.randn(1, 6, 96)
    am = torch.ones(1, 6, dtype=torch.long)
    with torch.no_grad():
        for a, b in zip(head(aux, ids, am, steps=3), again(aux, ids, am, steps=3)):
            assert torch.equal(a, b)
    assert torch.equal(again.d2t, head.d2t) and torch.equal(again.t2d, head.t2d)
    cfg = (tmp_path / "h" / "config.json").read_text()
    assert '"LlamaForCausalLMEagle3"' in cfg and '"draft_vocab_size": 50' in cfg


def test_a_wider_mlp_is_built_saved_reloaded_and_exported(target, tmp_path):
    """draft.intermediate_size (the head's one free size) reaches the layer, its config.json and a valid vLLM export."""
    from specdistill.drafts.eagle3.export import export_eagle3, validate_export

    torch.manual_seed(0)
    head = build_eagle3(target, torch.arange(40), None, intermediate_size=3 * 37)
    mlp = head.midlayer.mlp
    assert mlp.gate_proj.weight.shape == (111, 32) and mlp.down_proj.weight.shape == (32, 111)
    assert head.config.intermediate_size == 111 != target.config.intermediate_size
    head.save_pretrained(tmp_path / "h")
    again = Eagle3Head.from_pretrained(tmp_path / "h")
    assert again.config.intermediate_size == 111
    export_eagle3(tmp_path / "h", tmp_path / "v", "vllm")
    assert validate_export(tmp_path / "v").config["intermediate_size"] == 111  # raises on any problem
    with pytest.raises(ValueError, match="intermediate_size=0"):
        build_eagle3(target, torch.arange(40), None, intermediate_size=0)


def test_aux_ids_defaults_and_errors(target):
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(4) == [1, 2, 3]
    assert default_aux_layer_ids(2) == [1, 1, 1]
    assert default_aux_layer_ids(1) == [0, 0, 0]
    with pytest.raises(ValueError, match="aux_layer_ids"):
        build_eagle3(target, torch.arange(V), [1, 2, 9])
    with pytest.raises(ValueError, match="out of range"):
        Target(target, [0, 5])


def test_objective_is_finite_and_masks_out_of_vocab(target):
    head = _head(target, vd=30).train()
    tgt = Target(target, head.config.aux_layer_ids)
    ids = torch.randint(0, V, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    out = Eagle3Objective(steps=3)(batch, Models(head, tgt))
    assert torch.isfinite(out.loss).all()
    assert torch.allclose(out.weight.unique(), torch.tensor([0.64, 0.8, 1.0]))
    # Step j's loss entries are the loss positions t+1+j in order; the target's argmax there must be in the draft vocab
    # (30 of 97 ids), else the entry is masked: exactly zero, so it adds neither loss nor gradient.
    with torch.no_grad():
        argmax = tgt.outputs(batch).logits.argmax(-1)  # (B, T)
    in_vocab = torch.cat([head.t2d[argmax[:, 1 + j:]].flatten() for j in range(3)])  # all positions are loss positions
    assert len(in_vocab) == len(out.loss) and 0 < int(in_vocab.sum()) < len(in_vocab)  # both kinds occur
    assert torch.equal(out.loss[~in_vocab], torch.zeros(int((~in_vocab).sum())))
    assert (out.loss[in_vocab] > 0).all()
    out.loss.mul(out.weight).sum().backward()
    assert head.fc.weight.grad is not None and head.embed_tokens.weight.grad is None


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "linear", "factor": 4.0}])
def test_head_rope_matches_the_targets_rotary_embedding(rope):
    """The head rotates q/k exactly as an HF Llama with the same rope parameters (Llama-3.1 uses llama3 scaling):
    a wrong frequency table would shift every drafted position and silently cut acceptance in serving."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specdistill.drafts.eagle3.model import Eagle3Config
    from specdistill.models.layers import rope_cos_sin

    rp = {"rope_type": "default", "rope_theta": 5e5, **(rope or {})}
    tcfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, vocab_size=50, rope_parameters=rp)
    head = Eagle3Head(Eagle3Config.from_target(tcfg, 20, [0, 1, 1]))
    pos = torch.tensor([[0, 5, 63, 64, 300, 511]])
    cos, sin = rope_cos_sin(pos, head.rope_inv_freq, head.rope_attention_factor, torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(tcfg)(torch.zeros(1, 6, 16), pos)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-5, atol=1e-5)
    assert (head.config.rope_scaling is None) == (rope is None)
    with pytest.raises(ValueError, match="sequence length"):
        Eagle3Head(Eagle3Config.from_target(LlamaConfig(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=50,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), 20, [0, 1, 1]))


def _reference_eagle3_loss(head, target_logits, aux, ids, am, lm, steps, decay):
    """The objective as first written: full target logits at every position, every slot read out, restricted per
    step."""
    from specdistill.objectives.eagle3 import shift_left

    out = []
    for j, q_logits in enumerate(head(aux, ids, am, steps=steps)):
        mask = shift_left(lm, 1 + j, fill=False)
        p, in_vocab = draft_vocab_targets(shift_left(target_logits, 1 + j)[mask], head.t2d)
        ce = -(p * torch.log_softmax(q_logits[mask].float(), -1)).sum(-1) * in_vocab
        out.append(ce * decay ** j)
    return torch.cat(out)


@pytest.mark.parametrize("source", ["online", "features", "features+argmax"])
def test_objective_equals_the_full_logit_reference_on_every_target_path(target, source):
    """Restricted logits from stored features, the stored argmax, and reading out only scored slots change no loss."""
    head = _head(target, vd=60)
    wrapped = Target(target, default_aux_layer_ids(4))
    head.config.aux_layer_ids = list(wrapped.aux_layer_ids)
    g = torch.Generator().manual_seed(3)
    B, T = 3, 12
    ids = torch.randint(0, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[2, 9:] = 0
    lm = torch.zeros(B, T, dtype=torch.long)
    lm[:, 4:10] = 1
    lm = lm * am
    with torch.no_grad():
        o = target(input_ids=ids, attention_mask=am, output_hidden_states=True)
    aux = torch.cat([o.hidden_states[k] for k in wrapped.aux_layer_ids], -1)
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm}
    if source != "online":
        batch.update(aux_hidden=aux, final_hidden=o.hidden_states[-1])
    if source == "features+argmax":
        batch["target_argmax"] = o.logits.argmax(-1)
    obj = Eagle3Objective(steps=3, decay=0.8)
    got = obj(batch, Models(head, wrapped))
    ref = _reference_eagle3_loss(head, o.logits, aux, ids, am, lm.bool(), 3, 0.8)
    torch.testing.assert_close(got.loss * got.weight, ref, atol=1e-4, rtol=1e-4)


def test_a_config_that_disagrees_with_the_tensors_is_named(target, tmp_path):
    import json

    _head(target, vd=50).save_pretrained(tmp_path / "h")
    cfg_path = tmp_path / "h" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] + 8  # hand-edited, or copied from another head
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"disagrees with its tensors: midlayer\.mlp\..*intermediate_size"):
        Eagle3Head.from_pretrained(tmp_path / "h")
