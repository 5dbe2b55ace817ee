"""The GPU code paths, exercised on CPU: the EAGLE-3 head under bf16 autocast and with bf16 weights beside an fp32
target, its fused TTT attention against a naive reference, chain logits through a wrapper's forward (DDP / DeepSpeed),
Draft-OPD's metric keys independent of each rank's data, the precision drafts decode in, and every recipe trained
under trainer.mixed_precision=bf16 against its fp32 run."""
import math

import pytest
import torch

from specdistill.drafts import draft_adapter
from specdistill.drafts.base import cast_for_decoding, decoding_precision
from specdistill.drafts.eagle3.model import TTTKeys, TTTMask, _ttt_attend, naive_ttt_attend
from specdistill.models.target import Target
from specdistill.objectives import Models
from specdistill.objectives.draft_opd import DraftOPDObjective
from tests.conftest import ONPOLICY_ALONE, assert_bf16_near_fp32, make_tiny_lm, noisy_eagle3_head, single_thread

V, HT = 48, 32

_single_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def target():
    t = make_tiny_lm(V, layers=4, hidden=HT, seed=0).eval()
    t.lm_head.weight.data.mul_(4.0)  # peaked p: rollouts accept some drafts and reject others
    return t


def _head(target, vd=40, seed=0):
    return noisy_eagle3_head(target, vd, seed)


def _batch(B=2, T=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1:, T - 3:] = 0  # right padding (every row but the first)
    aux = torch.randn(B, T, 3 * HT, generator=g)
    return aux, ids, am


# ----------------------------------------------------------------------------------------------- TTT attention
@pytest.mark.parametrize("j", [0, 1, 3, 9])  # 9 diagonals: two blocks of 8 extra coordinates
def test_fused_ttt_attention_equals_the_naive_one_values_and_grads(j):
    B, nh, n, T, hd = 2, 3, 6, 6, 8
    g = torch.Generator().manual_seed(j)
    leaves = [torch.randn(B, nh, n, hd, generator=g), torch.randn(B, nh, T, hd, generator=g),
              torch.randn(B, nh, T, hd, generator=g)] + [torch.randn(B, nh, n, hd, generator=g) for _ in range(2 * j)]
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 4:] = False
    allow = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]  # (B, 1, n, T)
    allow = allow.clone()
    allow[0, 0, 2] = False  # a query barred from every step-0 key
    outs, grads = [], []
    # the fused form with its own extended keys, and with keys extended once for an unroll of 10 diagonals (TTTKeys:
    # step j reads the first T + j columns)
    shared = lambda q, k0, v0, mask, dk, dv, scale: _ttt_attend(q, k0, v0, mask, dk, dv, scale,  # noqa: E731
                                                                TTTKeys.of(k0, v0, 10))
    for attend, mask in ((naive_ttt_attend, allow), (_ttt_attend, TTTMask(allow, j)), (shared, TTTMask(allow, 10))):
        xs = [x.clone().requires_grad_(True) for x in leaves]
        out = attend(xs[0], xs[1], xs[2], mask, xs[3: 3 + j], xs[3 + j:], 1 / math.sqrt(hd))
        (out * torch.linspace(-1, 1, hd)).sum().backward()
        outs.append(out.detach())
        grads.append([x.grad for x in xs])
    for k in (1, 2):
        torch.testing.assert_close(outs[k], outs[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(grads[k], grads[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _saved_storages(head, aux, ids, am, steps) -> list[int]:
    """Bytes of each distinct storage a head's TTT unroll keeps for backward, as autograd saves them."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head(aux, ids, am, steps=steps)
    return list(seen.values())


def test_the_fused_unroll_keeps_no_score_matrix_for_backward(target, monkeypatch):
    """The naive unroll keeps a (B, heads, T, T) softmax per step; the fused one keeps q/k/v-sized tensors and one
    (B, 1, T, T + steps) mask for the whole unroll, so what it holds grows as T, not as heads x T^2 per step."""
    from specdistill.drafts.eagle3 import model as eagle3

    head = _head(target).train()
    T, steps, nh = 256, 7, head.config.num_attention_heads
    aux, ids, am = _batch(B=1, T=T)
    score = nh * T * T * 4                                                   # bytes of one fp32 (1, nh, T, T)
    fused = _saved_storages(head, aux, ids, am, steps)
    monkeypatch.setattr(eagle3, "_ttt_attend",
                        lambda q, k0, v0, mask, diag_k, diag_v, scale, ext=None:
                        naive_ttt_attend(q, k0, v0, mask.allow, diag_k, diag_v, scale))
    naive = _saved_storages(head, aux, ids, am, steps)
    assert sum(n >= score for n in naive) >= steps and max(fused) < score / 2
    assert sum(n >= 4 * T * T for n in fused) == 1  # the unroll's one fp32 (T, T + steps) mask


# ----------------------------------------------------------------------------------------------- bf16
def test_head_trains_under_bf16_autocast_close_to_fp32(target):
    """Mixed precision (trainer.mixed_precision=bf16): the TTT unroll and the sparse chain unroll run, backpropagate
    finite gradients, and stay near the fp32 values."""
    head = _head(target)
    aux, ids, am = _batch()
    slot = torch.tensor([[2, 5], [1, 6]])
    tokens = torch.randint(3, V, (2, 2, 2), generator=torch.Generator().manual_seed(1))
    results = {}
    for name, on in (("fp32", False), ("bf16", True)):
        head.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            logits = head(aux, ids, am, steps=3)
            chain = head.unroll_chains(aux, ids, am, slot, tokens, steps=3)
            loss = sum(x.float().logsumexp(-1).sum() for x in logits) + sum(h.float().square().sum() for h in chain)
        loss.backward()
        results[name] = ([x.float().detach() for x in logits], [h.float().detach() for h in chain],
                         head.fc.weight.grad.clone())
    for ref, got in zip(results["fp32"][0] + results["fp32"][1], results["bf16"][0] + results["bf16"][1]):
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max() <= 0.05 * ref.abs().max(), (got - ref).abs().max()
    g32, g16 = results["fp32"][2], results["bf16"][2]
    assert torch.isfinite(g16).all() and (g16 - g32).norm() <= 0.1 * g32.norm()


def test_a_bf16_head_reads_an_fp32_targets_features(target):
    """DeepSpeed bf16 casts the head's weights, autocast is off, and an fp32 target's features arrive as fp32: the
    head casts them at its input. Its RoPE frequencies stay fp32 (a buffer that moves with it but keeps its dtype)."""
    head = _head(target)
    aux, ids, am = _batch()
    with torch.no_grad():
        want = head(aux, ids, am, steps=2)
        head16 = _head(target).to(torch.bfloat16)
        got = head16(aux, ids, am, steps=2)
    assert head16.rope_inv_freq.dtype == torch.float32 and torch.equal(head16.rope_inv_freq, head.rope_inv_freq)
    for a, b in zip(want, got):
        assert b.dtype == torch.bfloat16 and torch.isfinite(b).all()
        assert (b.float() - a).abs().max() <= 0.05 * a.abs().max()


def test_rope_frequencies_are_a_non_persistent_buffer(target):
    head = _head(target)
    assert "rope_inv_freq" in dict(head.named_buffers()) and "rope_inv_freq" not in head.state_dict()
    moved = head.to(torch.float64)
    assert moved.rope_inv_freq.dtype == torch.float32


# ----------------------------------------------------------------------------------------------- wrappers
class Wrapper(torch.nn.Module):
    """What DDP and DeepSpeed's engine look like to a caller: `.module` and a forward, nothing else of the head's."""

    def __init__(self, module):
        super().__init__()
        self.module, self.calls = module, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


def test_chain_logits_of_a_wrapped_head_run_through_the_wrappers_forward(target):
    """Draft-OPD's loss forward on a head inside DDP: one call of the wrapper's forward (whose reducer syncs the
    gradients), the same logits as the bare head."""
    head = _head(target)
    aux, ids, _ = _batch(T=9)
    rows = [ids[0], ids[1, :7]]
    row, ctx, index = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([5, 6, 7, 4, 5]), torch.tensor([0, 1, 2, 0, 1])
    bare = draft_adapter(head).logits_at(rows, row, ctx, index, aux, pad_id=0)
    wrapped = Wrapper(head)
    got = draft_adapter(wrapped).logits_at(rows, row, ctx, index, aux, pad_id=0)
    assert wrapped.calls == 1 and got.shape == (5, 40) and got.requires_grad
    torch.testing.assert_close(got, bare)


# ----------------------------------------------------------------------------------------------- Draft-OPD metrics
def _opd_batch(with_loss_tokens=True):
    lengths = torch.tensor([7, 3, 5])
    ids = torch.randint(3, V, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(7) >= 7 - lengths[:, None]).long()
    ids = ids * mask
    lm = torch.zeros_like(ids)
    batch = {"input_ids": torch.cat([ids, ids], 1), "attention_mask": torch.cat([mask, mask], 1),
             "loss_mask": torch.cat([lm, lm + int(with_loss_tokens)], 1)}
    return {k: torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(v, batch["attention_mask"])])
            for k, v in batch.items()}  # right-padded, as collate makes them


def test_draft_opd_reports_the_same_metric_keys_whatever_the_ranks_data(target):
    """The loop reduces the metrics as one stacked tensor across ranks, so every rank must report the same keys: an
    empty replay sample (the first step, or a rank without rejections) and a batch without loss tokens (kd_weight)
    must not drop any."""
    head = _head(target).train()
    models = Models(head, Target(target, head.config.aux_layer_ids))
    obj = DraftOPDObjective(gamma=3, max_new_tokens=8, temperature=1.0, replay_ratio=1.0, kd_weight=0.5)
    keys = []
    for with_loss_tokens in (True, False, True):
        out = obj(_opd_batch(with_loss_tokens), models)
        keys.append(sorted(out.metrics))
        assert all(torch.isfinite(v).all() for v in out.metrics.values())
    assert obj.state.buffer.priorities().numel() > 0  # later calls replayed something; the first had nothing
    assert keys[0] == keys[1] == keys[2] and "replay_loss_sum" in keys[0] and "kd_loss_sum" in keys[0]


# ----------------------------------------------------------------------------------------------- decoding precision
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafts_decode_in_the_targets_dtype(target, dtype):
    """A draft decodes in its target's precision: a training draft through autocast (its weights stay fp32), a draft
    loaded to evaluate cast to the target's dtype; an fp32 target leaves both alone."""
    head = _head(target)
    aux, ids, am = _batch()
    with torch.no_grad(), decoding_precision(target.to(dtype)):
        logits = head(aux, ids, am, steps=1)[0]
    assert logits.dtype == dtype and head.fc.weight.dtype == torch.float32
    loaded = cast_for_decoding(_head(target), target)  # a draft loaded to evaluate: cast once, for good
    target.float()
    assert loaded.fc.weight.dtype == dtype and loaded.rope_inv_freq.dtype == torch.float32


# ----------------------------------------------------------------------------------------------- every recipe in bf16
STEPS = ["trainer.max_steps=2", "trainer.lr=3e-3", "trainer.warmup_steps=0", "trainer.export_formats=[]",
         "trainer.measure_roofline=false"]
ON_POLICY = ["objective.max_new_tokens=6", "objective.gamma=2", "objective.replay_ratio=0.5"]
# recipe, overrides: the tiny target (tests/conftest.py) unless the recipe needs an MoE one
MATRIX = {
    "sft": ("sft", []),
    "kd": ("kd", []),
    "eagle3": ("eagle3", ["draft.draft_vocab_size=96"]),
    "eagle3_serve": ("eagle3_serve", ["draft.draft_vocab_size=96", "trainer.epochs=null"]),  # regenerates first
    "draft_opd_lm": ("draft_opd", ONPOLICY_ALONE + ON_POLICY),
    "draft_opd_eagle3": ("draft_opd", ON_POLICY + [  # 1 warm-up step (eagle3), the hand-over, 1 on-policy step
        "draft.draft_vocab_size=96", "data.regenerate.enabled=false", "warmup.steps=1", "warmup.epochs=null",
        "warmup.micro_batch_size=2", "warmup.warmup_steps=0", "warmup.schedule_steps=null", "trainer.max_steps=1"]),
    "moe_kd": ("moe_kd", ["draft.num_layers=2", "draft.moe.num_experts=2", "draft.moe.coverage=null",
                          "draft.moe.profile_batches=2"]),
}


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from tests.conftest import make_tokenizer
    from tests.moe.conftest import make_tiny_moe

    d = tmp_path_factory.mktemp("tiny_mixtral")
    tok = make_tokenizer()
    make_tiny_moe("mixtral", len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.parametrize("name", list(MATRIX))
def test_every_recipe_trains_under_bf16_autocast_near_its_fp32_run(name, tiny_target_dir, tiny_moe_dir, tiny_data_file,
                                                                   tmp_path):
    """trainer.mixed_precision=bf16 (CPU autocast, as a GPU's `auto` picks): the held-out check, every step and the
    hand-over run; the losses are finite, and the first step's (same weights, same data and rollout) is within 5% of
    the fp32 run's. Later steps start from weights the two runs updated apart."""
    recipe, extra = MATRIX[name]
    target = tiny_moe_dir if recipe.startswith("moe") else tiny_target_dir
    assert_bf16_near_fp32(recipe, target, tiny_data_file, tmp_path, STEPS + extra)
