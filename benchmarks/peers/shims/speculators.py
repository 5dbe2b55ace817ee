"""CPU shim for speculators 0.9.0's trainer (apply() before speculators.train.cli.main runs).

What it changes, and why:
1. speculators.train.trainer.get_local_rank -> "cpu": the trainer moves the model and every batch to `local_rank`, an
   int that names a CUDA device.
2. torch.accelerator.synchronize -> no-op when no accelerator exists: its step timer synchronizes the accelerator.
3. Trainer.device_type -> "cpu": with no accelerator it autocasts on "cuda", which CPU tensors ignore with a warning.
4. With a wall-time budget (the equal-wall-time arms): the train loader ends its epoch once the budget, counted from
   the end of the trainer's setup, is spent, so the trainer saves its checkpoint as at a normal epoch end.
   The loader counts the loss tokens (loss_mask) of the batches it hands to the trainer (LOSS_TOKENS), so an epoch cut
   short reports what was trained on (EPOCH_LOSS_TOKENS at each checkpoint), not the epoch's nominal count.
5. Timing only (behaviour unchanged): run_training, val_epoch and maybe_save_checkpoint are timed, so the benchmark
   counts training time alone (TIMES) and knows the training time at each epoch's checkpoint (EPOCH_TRAIN_S).
What the runner passes as flags instead of patching: --loss-implementation eager (the fused loss is a Triton kernel),
--draft-attn-impl sdpa (flex attention compiles through Triton), --hidden-states-dtype float32 (bf16 matmuls run ~50x
slower than fp32 on this CPU), --num-workers 0 (dataloader workers would compete for the two cores).
"""
import time

TIMES = {"run_training": 0.0, "val_epoch": 0.0, "maybe_save_checkpoint": 0.0}
EPOCH_TRAIN_S: dict = {}  # epoch (0-based, as it names checkpoint folders) -> training seconds when it was saved
LOSS_TOKENS = {"seen": 0}  # loss tokens in the training batches handed to the trainer so far
EPOCH_LOSS_TOKENS: dict = {}  # epoch (0-based) -> LOSS_TOKENS["seen"] when its checkpoint was saved


def batch_loss_tokens(batch) -> int:
    """The loss tokens of one speculators training batch: its loss_mask's true entries."""
    if not isinstance(batch, dict) or "loss_mask" not in batch:
        raise RuntimeError("speculators' training batch has no 'loss_mask' (its collate format changed?): the "
                           "benchmark cannot count the loss tokens trained on; update shims/speculators.py")
    return int(batch["loss_mask"].sum())


class DeadlineLoader:
    """A DataLoader that counts the loss tokens it yields (LOSS_TOKENS) and, with a `deadline`, stops yielding once
    time.time() passes it (len and batch_sampler pass through)."""

    def __init__(self, loader, deadline=None):
        self.loader, self.deadline = loader, deadline

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            if self.deadline is not None and time.time() > self.deadline:
                return
            LOSS_TOKENS["seen"] += batch_loss_tokens(batch)
            yield batch


def training_seconds(started: float) -> float:
    """Seconds since run_training started, less validation and checkpoint saving."""
    return time.perf_counter() - started - TIMES["val_epoch"] - TIMES["maybe_save_checkpoint"]


def apply(wall_seconds=None):
    import torch
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    T = trainer.Trainer
    original_init = T.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"
        self.train_loader = DeadlineLoader(self.train_loader, time.time() + wall_seconds if wall_seconds else None)

    def timed(name):
        method = getattr(T, name)

        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            if name == "run_training":
                self._specdistill_started = start
            if name == "maybe_save_checkpoint" and args and isinstance(args[0], int):
                EPOCH_TRAIN_S[args[0]] = training_seconds(self._specdistill_started)
                EPOCH_LOSS_TOKENS[args[0]] = LOSS_TOKENS["seen"]
            try:
                return method(self, *args, **kwargs)
            finally:
                if name != "run_training":
                    TIMES[name] += time.perf_counter() - start
                else:
                    TIMES[name] = training_seconds(start)

        return wrapper

    T.__init__ = init
    for name in TIMES:
        setattr(T, name, timed(name))
