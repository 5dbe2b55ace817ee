"""CPU shim for speculators 0.9.0's trainer (apply() before speculators.train.cli.main runs).

What it changes, and why:
1. speculators.train.trainer.get_local_rank -> "cpu": the trainer moves the model and every batch to `local_rank`, an
   int that names a CUDA device.
2. torch.accelerator.synchronize -> no-op when no accelerator exists: its step timer synchronizes the accelerator.
3. Trainer.device_type -> "cpu": with no accelerator it autocasts on "cuda", which CPU tensors ignore with a warning.
4. With a deadline (the equal-wall-time arms): the train loader ends its epoch once the deadline has passed, so the
   trainer saves its checkpoint as at a normal epoch end.
What the runner passes as flags instead of patching: --loss-implementation eager (the fused loss is a Triton kernel),
--draft-attn-impl sdpa (flex attention compiles through Triton), --hidden-states-dtype float32 (bf16 matmuls run ~50x
slower than fp32 on this CPU), --num-workers 0 (dataloader workers would compete for the two cores).
"""
import time


class DeadlineLoader:
    """A DataLoader that stops yielding once time.time() passes `deadline` (len and batch_sampler pass through)."""

    def __init__(self, loader, deadline: float):
        self.loader, self.deadline = loader, deadline

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            if time.time() > self.deadline:
                return
            yield batch


def apply(deadline=None):
    import torch
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    original_init = trainer.Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"
        if deadline is not None:
            self.train_loader = DeadlineLoader(self.train_loader, deadline)

    trainer.Trainer.__init__ = init
