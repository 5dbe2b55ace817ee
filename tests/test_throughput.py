"""The MFU counter: torch's FLOP count of a known step, FLOPs restated on real tokens (padding changes nothing), the
MFU arithmetic, and the loop logging it."""
import json

import pytest
import torch

from specdistill.data.chat import collate
from specdistill.train.throughput import Mfu, count_flops, step_flops


def test_count_flops_of_a_linear_forward_backward_is_6_b_in_out():
    torch.manual_seed(0)
    B, n_in, n_out = 7, 13, 5
    lin = torch.nn.Linear(n_in, n_out, bias=False)
    x = torch.randn(B, n_in, requires_grad=True)
    counted = count_flops(lambda: lin(x).sum().backward())
    # forward 2*B*in*out; backward: grad of x and grad of W, 2*B*in*out each
    assert counted.flops == 6 * B * n_in * n_out


def test_recomputation_of_checkpointed_regions_is_not_model_work():
    """MFU counts each FLOP of the model once: a region checkpointed with checkpoint_contexts counts as if it kept
    its activations, and what its backward recomputed is reported apart; without the contexts torch counts it."""
    from contextlib import nullcontext

    from torch.utils.checkpoint import checkpoint

    from specdistill.flops import checkpoint_contexts

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    plain = count_flops(lambda: mlp(x).sum().backward())
    ours = count_flops(lambda: checkpoint(mlp, x, use_reentrant=False, context_fn=checkpoint_contexts).sum().backward())
    torchs = count_flops(lambda: checkpoint(mlp, x, use_reentrant=False,
                                            context_fn=lambda: (nullcontext(), nullcontext())).sum().backward())
    assert plain.recomputed == 0 and ours.flops == plain.flops
    assert ours.recomputed == 2 * 8 * 16 * 64  # the first linear's forward again (the GELU's input), nothing else
    assert torchs.flops == plain.flops + ours.recomputed  # the counter alone counts the recomputation


def test_the_eagle3_step_counts_the_same_flops_with_and_without_checkpointed_steps(tiny_target_dir, tiny_data_file,
                                                                                   tmp_path):
    from specdistill.build import build
    from tests.conftest import compose, tiny_overrides

    c = build(compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "run", tmp_path / "cache")))
    objective = c.phases.at(0).objective
    batch = c.phases.at(0).batches.micro_batches(0)[0]
    counts = {}
    for ckpt in (False, True):
        objective.checkpoint_steps = ckpt
        counts[ckpt] = count_flops(lambda: objective(batch, c.models).loss.sum().backward())
    assert counts[True].flops == counts[False].flops and counts[False].recomputed == 0
    assert counts[True].recomputed > 0.1 * counts[True].flops  # the unrolled layers ran again in backward


def rows(lengths: list[int]) -> list[dict]:
    return [{"input_ids": [3 + (7 * i + j) % 40 for j in range(n)], "loss_mask": [j % 2 for j in range(n)]}
            for i, n in enumerate(lengths)]


def pad_to(batch: dict, T: int) -> dict:
    """The same rows right-padded to T slots."""
    extra = T - batch["input_ids"].shape[1]
    return {k: torch.nn.functional.pad(v, (0, extra)) for k, v in batch.items()}


def per_token_step(batch: dict) -> None:
    """A forward + backward whose every matmul runs over all B x T slots (embedding, then two linear layers)."""
    torch.manual_seed(0)
    emb, up, down = torch.nn.Embedding(48, 16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
    h = down(torch.relu(up(emb(batch["input_ids"]))))  # (B, T, 16)
    (h.sum(-1) * batch["loss_mask"]).sum().backward()


def counted(batch: dict):
    return step_flops(count_flops(lambda: per_token_step(batch)).flops, [batch])


def test_padding_does_not_change_the_useful_flops_of_a_batch():
    batch = collate(rows([5, 9, 3]), pad_id=0)  # (3, 9): 17 real tokens in 27 slots
    counts = {T: counted(pad_to(batch, T)) for T in (9, 16, 40)}
    assert counts[40].flops > 4 * counts[9].flops  # the executed count grows with the padding
    assert {c.tokens for c in counts.values()} == {17}
    assert counts[16].useful_flops == pytest.approx(counts[9].useful_flops)
    assert counts[40].useful_flops == pytest.approx(counts[9].useful_flops)
    # unpadded, one row at a time: the same FLOPs
    alone = sum(counted(collate([r], 0)).flops for r in rows([5, 9, 3]))
    assert counts[40].useful_flops == pytest.approx(alone)


def test_padding_moves_a_real_eagle3_step_by_a_few_percent(tiny_target_dir, tiny_data_file, tmp_path):
    """On the real objective the count is first-order: attention grows with a row's length and the head runs at
    loss positions only, so doubling the slots with padding moves the useful FLOPs a little while the executed ones
    nearly double."""
    from specdistill.build import build
    from tests.conftest import compose, tiny_overrides

    c = build(compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "run", tmp_path / "cache")))
    phase = c.phases.at(0)
    batch = phase.batches.micro_batches(0)[0]
    T = batch["input_ids"].shape[1]
    padded = {k: torch.cat([v, torch.zeros_like(v)], 1) if torch.is_tensor(v) and v.shape[:2] == (v.shape[0], T)
              else v for k, v in batch.items()}  # every (B, T, ...) tensor twice as long, the new half padding

    def eagle3_step(b: dict):
        return step_flops(count_flops(lambda: phase.objective(b, c.models).loss.sum().backward()).flops, [b])

    plain, twice = eagle3_step(batch), eagle3_step(padded)
    assert twice.tokens == plain.tokens and twice.slots == 2 * plain.slots
    assert twice.flops > 1.8 * plain.flops
    assert twice.useful_flops == pytest.approx(plain.useful_flops, rel=0.1)


def test_step_flops_adds_up_micro_batches():
    a, b = collate(rows([4, 2]), 0), collate(rows([3]), 0)
    f = step_flops(1000, [a, b])
    assert (f.slots, f.tokens) == (2 * 4 + 3, 9)
    assert f.useful_flops == pytest.approx(1000 * 9 / 11)


def test_mfu_arithmetic():
    m = Mfu(peak_flops_per_s=4e13, flops_per_token=2e8)
    assert m.achieved_flops_per_s(1e5) == 2e13
    assert m.fraction(1e5) == 0.5
    out = m.metrics(1e5)
    assert out["train/mfu"] == 0.5 and out["train/flops_per_token"] == 2e8 and out["train/achieved_tflops"] == 20.0


def test_the_loop_logs_mfu_and_the_peak(tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.build import build
    from specdistill.train.loop import fit
    from tests.conftest import compose, tiny_overrides

    cfg = compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "run", tmp_path / "cache")
                  + ["trainer.max_steps=2", "trainer.grad_accum=1"])
    fit(build(cfg))
    rows_ = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows_ if "train/loss" in r]
    assert all(r["train/flops_per_token"] > 0 for r in train)
    assert [r.get("train/instrumented", False) for r in train] == [True, False]  # the FLOP-counted step: no rate
    train = train[1:]
    assert train and all(0 < r["train/mfu"] < 1 for r in train)
    for r in train:  # mfu is the achieved rate over the peak, on real input tokens
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        peak = summary["device_peak"]["peak/flops_per_s"]
        assert r["train/mfu"] == pytest.approx(r["train/input_tokens_per_s"] * r["train/flops_per_token"] / peak)
    assert summary["device_peak"]["peak/source"] == "measured" and summary["device_peak"]["peak/dtype"] == "float32"
    # a per-token count: the EAGLE-3 step costs at least the head's matmuls over its unrolled steps
    head_params = sum(p.numel() for n, p in build(cfg).models.draft.named_parameters() if p.requires_grad)
    assert train[0]["train/flops_per_token"] > 2 * head_params
