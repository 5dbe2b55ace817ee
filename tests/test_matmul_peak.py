"""The matmul peak times a batch of matmuls per sync: on a device whose sync costs more than a matmul (a GPU and
small ones), a sync per matmul reads the peak several times too low. Checked on a fake device and clock."""

import pytest

from specdistill.train.throughput import sustained_gflops

FLOPS = 2e9        # per op
OP_S = 0.001       # compute time of one op: the true rate is 2000 GFLOPS
SYNC_S = 0.005     # a sync's round trip


class FakeDevice:
    """ops queue their compute time; sync() waits for the queue plus a fixed round trip, on a fake clock."""

    def __init__(self):
        self.now, self.queued, self.syncs = 0.0, 0.0, 0

    def clock(self) -> float:
        return self.now

    def op(self) -> None:
        self.queued += OP_S

    def sync(self) -> None:
        self.now += self.queued + SYNC_S
        self.queued = 0.0
        self.syncs += 1


def test_the_peak_is_the_sustained_rate_not_the_round_trip_rate():
    dev = FakeDevice()
    rate = sustained_gflops(dev.op, dev.sync, FLOPS, seconds=0.4, clock=dev.clock)
    true_rate = FLOPS / OP_S / 1e9
    per_op_sync_rate = FLOPS / (OP_S + SYNC_S) / 1e9                      # what a sync per matmul reads: 1/6
    assert rate == pytest.approx(true_rate, rel=0.1)
    assert rate > 5 * per_op_sync_rate
    assert dev.syncs < 12  # one per doubling batch, not one per op
