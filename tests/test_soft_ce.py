"""Soft cross-entropy: the fused chunked form equals the plain one in value and gradients, keeps no (N, V) tensor for
backward, and the EAGLE-3 objective built on it (with and without per-step checkpointing) trains exactly as the plain
formula does."""
import pytest
import torch
import torch.nn.functional as F

from benchmarks.eagle3_memory import SavedBytes
from specdistill.drafts.eagle3.model import default_aux_layer_ids
from specdistill.losses.soft_ce import linear_soft_cross_entropy, soft_cross_entropy
from specdistill.models.target import Target
from specdistill.objectives.base import Models
from specdistill.objectives.eagle3 import Eagle3Objective
from specdistill.tensors import shift_left
from tests.conftest import make_tiny_lm, noisy_eagle3_head

V = 97


def _inputs(N=11, H=16, Vd=37, M=20, seed=0):
    """h (N, H), weight (Vd, H) needing grad; target logits (M, Vd); rows (N,) with repeats; mask (N,) with holes."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).requires_grad_(True)
    w = (torch.randn(Vd, H, generator=g) / H ** 0.5).requires_grad_(True)
    p_logits = torch.randn(M, Vd, generator=g) * 3
    rows = torch.randint(0, M, (N,), generator=g)
    mask = torch.rand(N, generator=g) < 0.7
    mask[0], mask[1] = True, False
    return h, w, p_logits, rows, mask


@pytest.mark.parametrize("chunk,compiled", [(1, False), (4, False), (None, False), (4, True), (None, True)])
def test_fused_equals_plain_in_loss_and_gradients(chunk, compiled):
    h, w, p_logits, rows, mask = _inputs()
    up = torch.rand(h.shape[0], generator=torch.Generator().manual_seed(1))  # a per-token upstream gradient
    plain = soft_cross_entropy(F.linear(h, w), p_logits, rows, mask)
    grads_plain = torch.autograd.grad((plain.loss * up).sum(), (h, w))
    fused = linear_soft_cross_entropy(h, w, p_logits, rows, mask, chunk=chunk, compiled=compiled)
    grads_fused = torch.autograd.grad((fused.loss * up).sum(), (h, w))
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(fused.q_argmax, plain.q_argmax)
    for a, b in zip(grads_fused, grads_plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # masked tokens: no loss, no gradient into their features
    assert torch.equal(fused.loss[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(grads_fused[0][~mask], torch.zeros_like(h[~mask]))


def test_compiled_kernels_take_any_chunk_and_vocabulary_and_a_failing_compiler_falls_back_with_a_warning(
        monkeypatch):
    from specdistill.losses import soft_ce

    for N, Vd, chunk in [(11, 37, 4), (30, 53, 7), (5, 37, None)]:  # other sizes: no recompile needed to be right
        h, w, p_logits, rows, mask = _inputs(N=N, Vd=Vd)
        eager = linear_soft_cross_entropy(h, w, p_logits, rows, mask, chunk=chunk)
        fused = linear_soft_cross_entropy(h, w, p_logits, rows, mask, chunk=chunk, compiled=True)
        torch.testing.assert_close(fused.loss, eager.loss, rtol=1e-5, atol=1e-6)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    kernels = soft_ce._Kernels()
    kernels.compiled = (broken, broken)  # what a compiler that fails at its first call leaves
    monkeypatch.setattr(soft_ce, "_KERNELS", kernels)
    h, w, p_logits, rows, mask = _inputs()
    with pytest.warns(UserWarning, match="torch.compile failed .*no C\\+\\+ compiler"):
        fused = linear_soft_cross_entropy(h, w, p_logits, rows, mask, compiled=True)
    torch.testing.assert_close(fused.loss, soft_cross_entropy(F.linear(h, w), p_logits, rows, mask).loss)
    assert kernels.failed and kernels.get(True)[0] is soft_ce._chunk_loss  # eager from then on


def test_soft_ce_is_at_least_the_entropy_with_equality_at_q_equal_p():
    """Gibbs: -sum p log q >= -sum p log p, equal when q = p."""
    _, _, p_logits, rows, _ = _inputs()
    p_log = p_logits[rows].log_softmax(-1)
    entropy = -(p_log.exp() * p_log).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(p_logits[rows], p_logits, rows).loss, entropy)
    other = p_logits[rows] + torch.randn_like(p_logits[rows])
    assert (soft_cross_entropy(other, p_logits, rows).loss > entropy).all()


def test_bad_inputs_fail_early_with_the_fix():
    h, w, p_logits, rows, mask = _inputs()
    with pytest.raises(ValueError, match="detach"):
        linear_soft_cross_entropy(h, w, p_logits.requires_grad_(True), rows, mask)
    with pytest.raises(ValueError, match="restrict the target"):
        linear_soft_cross_entropy(h, w[:-1], p_logits.detach(), rows, mask)
    with pytest.raises(ValueError, match="rows"):
        linear_soft_cross_entropy(h, w, p_logits.detach())  # 11 tokens, 20 target rows, no rows given
    with pytest.raises(ValueError, match="mask"):
        linear_soft_cross_entropy(h, w, p_logits.detach(), rows, mask[:-1])


def test_fused_keeps_no_token_by_vocabulary_tensor_for_backward():
    h, w, p_logits, rows, mask = _inputs(N=64, H=16, Vd=500, M=64)
    with SavedBytes(exclude=[w]) as plain:
        soft_cross_entropy(F.linear(h, w), p_logits, rows, mask).loss.sum()
    with SavedBytes(exclude=[w]) as fused:
        linear_soft_cross_entropy(h, w, p_logits, rows, mask).loss.sum()
    token_by_vocab = 64 * 500 * 4
    assert plain.bytes >= 2 * token_by_vocab  # the fp32 log-softmax and the gathered p
    # the features, the target's logits (shared by every step of an unroll), rows and mask: nothing (N, V) more
    assert fused.bytes <= h.nbytes + p_logits.nbytes + rows.nbytes + mask.nbytes
    assert fused.bytes < plain.bytes


@pytest.fixture(scope="module")
def target():
    return make_tiny_lm(V, layers=4, hidden=32, seed=1).eval()


def _batch(B=3, T=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[-1, T - 3:] = 0  # right padding
    lm = torch.zeros(B, T, dtype=torch.long)
    lm[:, 3:T - 1] = 1
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm * am}


def _plain_objective(head, wrapped, batch, steps, decay):
    """The objective's loss written with plain autograd: read-out logits, fp32 log-softmax, target p gathered per
    step. -> (losses * weights (N,), accuracy sums per step)"""
    ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"].bool()
    tgt = wrapped.draft_vocab_outputs(batch, lm, head.t2d)
    p_all = tgt.logits.float().softmax(-1)
    row = torch.full(lm.shape, -1, dtype=torch.long)
    row[lm] = torch.arange(p_all.shape[0])
    masks = [shift_left(lm, 1 + j, fill=False) for j in range(steps)]
    out, acc = [], []
    for j, (mask, q_logits) in enumerate(zip(masks, head(tgt.aux_hidden, ids, am, steps=steps, readout_at=masks))):
        sel = shift_left(row, 1 + j, fill=-1)[mask]
        p, in_vocab = p_all[sel], tgt.in_vocab[sel]
        q_log = F.log_softmax(q_logits.float(), -1)
        out.append(-(p * q_log).sum(-1) * in_vocab * decay ** j)
        acc.append(((q_log.argmax(-1) == p.argmax(-1)) & in_vocab).sum().float())
    return torch.cat(out), acc


@pytest.mark.parametrize("checkpoint", [False, True])
def test_objective_loss_gradients_and_metrics_equal_the_plain_formula(target, checkpoint):
    head = noisy_eagle3_head(target, 60).train()
    wrapped = Target(target, default_aux_layer_ids(4))
    head.config.aux_layer_ids = list(wrapped.aux_layer_ids)
    batch, steps = _batch(), 4
    params = [p for p in head.parameters() if p.requires_grad]
    ref, acc = _plain_objective(head, wrapped, batch, steps, 0.8)
    ref_grads = torch.autograd.grad(ref.sum(), params)
    got = Eagle3Objective(steps=steps, decay=0.8, checkpoint_steps=checkpoint)(batch, Models(head, wrapped))
    got_grads = torch.autograd.grad((got.loss * got.weight).sum(), params)
    torch.testing.assert_close(got.loss * got.weight, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert [got.metrics[f"acc_step{j}_sum"] for j in range(steps)] == acc


def test_checkpointed_steps_keep_less_for_backward(target):
    head = noisy_eagle3_head(target, 60).train()
    wrapped = Target(target, default_aux_layer_ids(4))
    head.config.aux_layer_ids = list(wrapped.aux_layer_ids)
    batch = _batch(B=2, T=32)
    saved = {}
    for checkpoint in (False, True):
        with SavedBytes(exclude=head.parameters()) as counter:
            Eagle3Objective(steps=4, checkpoint_steps=checkpoint)(batch, Models(head, wrapped))
        saved[checkpoint] = counter.bytes
    assert saved[True] < 0.6 * saved[False], saved
