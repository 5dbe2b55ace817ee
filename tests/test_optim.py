"""trainer.optimizer: AdamW, or Muon on the hidden weight matrices with AdamW on the rest (specdistill/optim.py).
Every trainable parameter is stepped by exactly one of the two; a scheduler's lr reaches both; the optimizer state
round-trips, so a resumed Muon run equals the uninterrupted one to the bit; sharded backends are refused early."""
from types import SimpleNamespace

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from specdistill.optim import MuonAdamW, build_optimizer, check_available, check_optimizer_backend, is_hidden_matrix
from specdistill.pipeline.run import build_components
from specdistill.train.checkpoint import list_checkpoints
from specdistill.train.loop import fit
from tests.conftest import compose, tiny_overrides


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 6)
        self.fc = torch.nn.Linear(12, 6, bias=True)
        self.norm = torch.nn.LayerNorm(6)
        self.lm_head = torch.nn.Linear(6, 11, bias=False)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        return self.lm_head(self.norm(self.fc(torch.cat([h, h], -1))))


def loss_of(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 11, (3, 5))
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def test_every_trainable_parameter_is_in_exactly_one_half():
    m = Toy()
    opt = build_optimizer(m, "muon", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    assert isinstance(opt, MuonAdamW)
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert muon == {id(m.fc.weight)}
    assert adamw == {id(p) for n, p in m.named_parameters() if p.requires_grad and n != "fc.weight"}
    assert id(m.frozen.weight) not in muon | adamw
    assert [p for g in opt.param_groups for p in g["params"]] == [m.fc.weight] + [
        p for n, p in m.named_parameters() if p.requires_grad and n != "fc.weight"]


def test_hidden_matrices_are_2d_and_not_embeddings_heads_or_norms():
    assert is_hidden_matrix("layers.0.self_attn.q_proj.weight", torch.zeros(4, 4))
    assert not is_hidden_matrix("layers.0.self_attn.q_proj.bias", torch.zeros(4))
    assert not is_hidden_matrix("embed_tokens.weight", torch.zeros(4, 4))
    assert not is_hidden_matrix("lm_head.weight", torch.zeros(4, 4))


def test_a_step_moves_both_halves_and_the_schedule_reaches_both():
    m = Toy()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = build_optimizer(m, "muon", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    sched = LambdaLR(opt, lambda step: 0.5)
    assert opt.muon.param_groups[0]["lr"] == opt.adamw.param_groups[0]["lr"] == pytest.approx(5e-3)
    loss_of(m).backward()
    opt.step()
    sched.step()
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert {"fc.weight", "fc.bias", "embed_tokens.weight", "lm_head.weight"} <= moved
    assert "frozen.weight" not in moved
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_state_round_trips_so_the_next_steps_match():
    def run(steps, state=None, model=None):
        m = model or Toy()
        opt = build_optimizer(m, "muon", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
        if state:
            opt.load_state_dict(state)
        for _ in range(steps):
            opt.zero_grad()
            loss_of(m).backward()
            opt.step()
        return m, opt

    torch.manual_seed(0)
    full, _ = run(4)
    torch.manual_seed(0)
    half, opt = run(2)
    state = opt.state_dict()
    resumed, _ = run(2, state=state, model=half)
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="trainer.optimizer=muon"):
        opt.load_state_dict(torch.optim.AdamW(Toy().parameters()).state_dict())


def test_a_loaded_state_keeps_the_schedule_reaching_both_halves():
    # torch's load_state_dict swaps an optimizer's group dicts for new ones; accelerate's prepare() loads the state once
    # to place it, so the outer groups must be the inner optimizers' own after every load
    m = Toy()
    opt = build_optimizer(m, "muon", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    opt.load_state_dict(opt.state_dict())
    sched = LambdaLR(opt, lambda step: 0.0 if step == 0 else 1.0)
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [0.0, 0.0]
    sched.step()
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [1e-2, 1e-2]
    before = m.fc.weight.detach().clone()
    loss_of(m).backward()
    opt.step()
    assert not torch.equal(m.fc.weight, before)


def test_a_muon_run_lowers_the_loss_of_an_eagle3_head(tiny_target_dir, tiny_data_file, tmp_path):
    # 30 steps on the tiny target: AdamW at this lr takes the loss from 23.5 to 22.8; an optimizer that does not step
    # the head (lr 0 reaching no group) leaves it within 0.05 of where it starts
    run = ["trainer.optimizer=muon", "trainer.max_steps=30", "trainer.measure_roofline=false",
           "trainer.export_formats=[]", "trainer.lr=1e-3", "trainer.max_grad_norm=0.5"]
    c = build_components(compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "run",
                                                          tmp_path / "cache") + run))
    losses = [h["train/loss"] for h in fit(c).history if "train/loss" in h]
    assert len(losses) == 30
    assert sum(losses[-3:]) / 3 < losses[0] - 0.25, losses


def test_adamw_is_the_default_and_an_unknown_optimizer_is_refused():
    assert type(build_optimizer(Toy(), "adamw", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)) is torch.optim.AdamW
    with pytest.raises(ValueError, match="adamw or muon"):
        build_optimizer(Toy(), "sgd", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)


@pytest.mark.parametrize("backend", ["DistributedType.DEEPSPEED", "DistributedType.FSDP"])
def test_muon_is_refused_where_parameters_are_split(backend):
    acc = SimpleNamespace(distributed_type=backend)
    with pytest.raises(ValueError, match="use DDP"):
        check_optimizer_backend("muon", acc)
    check_optimizer_backend("adamw", acc)
    check_optimizer_backend("muon", SimpleNamespace(distributed_type="DistributedType.MULTI_CPU"))


def test_a_muon_run_resumes_exactly(tiny_target_dir, tiny_data_file, tmp_path):
    run = ["trainer.optimizer=muon", "trainer.max_steps=4", "trainer.save_every=2", "trainer.keep_checkpoints=10",
           "trainer.measure_roofline=false", "trainer.export_formats=[]", "trainer.lr=5e-3"]

    def cfg(name, extra=()):
        return compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / name, tmp_path / "cache")
                       + run + list(extra))

    full = build_components(cfg("full"))
    assert isinstance(full.optimizer.optimizer, MuonAdamW)
    init = {k: v.clone() for k, v in full.accelerator.unwrap_model(full.models.draft).state_dict().items()}
    fit(full)
    ckpt = next(p for p in list_checkpoints(tmp_path / "full") if p.name == "step-0000002")
    resumed = build_components(cfg("resumed", [f"trainer.resume={ckpt}"]))
    fit(resumed)
    want = full.accelerator.unwrap_model(full.models.draft).state_dict()
    got = resumed.accelerator.unwrap_model(resumed.models.draft).state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert not torch.equal(want["fc.weight"], init["fc.weight"])  # the runs trained: equal, and not by standing still


def test_muon_is_refused_by_name_on_a_torch_without_it(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    accelerator = SimpleNamespace(distributed_type="NO")
    with pytest.raises(ValueError, match=r"torch\.optim\.Muon.*from 2\.9 on.*trainer\.optimizer=adamw"):
        check_optimizer_backend("muon", accelerator)
    with pytest.raises(ValueError, match="torch>=2.9"):
        build_optimizer(Toy(), "muon", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    check_available("adamw")  # AdamW needs nothing newer
