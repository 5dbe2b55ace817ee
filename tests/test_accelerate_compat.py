"""set_gradient_sync: the accumulating backward leaves the optimizer alone, the step's last one lets it step."""
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from specdistill.train.accelerate_compat import set_gradient_sync


def _backward_then_step(acc: Accelerator, model, opt, sync: bool) -> bool:
    """One backward and optimizer step under `sync`; whether the weights moved."""
    before = model.weight.detach().clone()
    set_gradient_sync(acc, sync)
    acc.backward(model(torch.ones(1, 2)).sum())
    opt.step()
    return not torch.equal(before, model.weight.detach())


def test_only_a_synced_backward_lets_the_wrapped_optimizer_step():
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        assert not _backward_then_step(acc, model, opt, sync=False) and acc.sync_gradients is False
        assert _backward_then_step(acc, model, opt, sync=True) and acc.sync_gradients is True
    finally:
        set_gradient_sync(acc, True)  # the gradient state is shared by every Accelerator in this process


def test_an_accelerate_without_the_setter_fails_naming_the_fix():
    fake = SimpleNamespace(gradient_state=SimpleNamespace())
    with pytest.raises(RuntimeError, match="accelerate_compat.py"):
        set_gradient_sync(fake, True)
