"""The dense peak reads the device's rate, not the host's issue rate: on a fake asynchronous device whose launch costs
more host time than a small product costs device time, the search grows the product until the device sets the rate.
Checked on a fake stream and clocks (milliseconds), and once on this CPU."""

import pytest
import torch

from specdistill.train.throughput import (DeviceClock, device_peak, host_clock, measure_matmul_peak, published_peak,
                                          seconds_per_op)

RATE = 800e12      # the fake device's dense rate (FLOP/s)
ISSUE_S = 15e-6    # host time to launch one op: 1024^3 takes 2.7 us of device time, far less
EVENT_S = 2e-6     # host time to record an event


class FakeStream:
    """An in-order device queue on a fake clock: the host pays ISSUE_S per launch; the device starts an op when it is
    launched and the previous op is done, and runs it for its FLOPs / RATE."""

    def __init__(self, rate: float = RATE, issue_s: float = ISSUE_S):
        self.rate, self.issue_s = rate, issue_s
        self.host = 0.0         # host clock
        self.device_free = 0.0  # when the device finishes all it has been given
        self.ops = 0
        self.largest = 0  # the largest product size launched

    def launch(self, flops: float) -> None:
        self.host += self.issue_s
        self.device_free = max(self.host, self.device_free) + flops / self.rate
        self.ops += 1

    def product(self, n: int):
        self.largest = max(self.largest, n)
        return lambda: self.launch(2 * n ** 3)

    def events(self) -> DeviceClock:
        """CUDA events: a mark fires on the device once everything issued before it is done."""
        def mark() -> float:
            self.host += EVENT_S
            self.device_free = max(self.host, self.device_free)
            return self.device_free

        def seconds(a: float, b: float) -> float:
            self.host = max(self.host, b)  # wait for b
            return b - a

        return DeviceClock(mark, seconds)

    def synchronize(self) -> None:
        self.host = max(self.host, self.device_free)


def test_the_fake_device_is_host_bound_at_1024():
    """The premise: 1024^3 products issued back to back read the host's issue rate, a small part of the device's."""
    dev = FakeStream()
    rate = 2 * 1024 ** 3 / seconds_per_op(dev.product(1024), 64, dev.events())
    assert rate < 0.25 * RATE


@pytest.mark.parametrize("clock", ["events", "host clock after sync"])
def test_the_peak_is_the_device_rate_although_a_launch_costs_more_than_a_small_product(clock):
    dev = FakeStream()
    timer = dev.events() if clock == "events" else host_clock(dev.synchronize, lambda: dev.host)
    peak = measure_matmul_peak(dev.product, timer)
    assert peak.flops_per_s == pytest.approx(RATE, rel=0.03)
    assert peak.op_s >= 1e-4  # one product lasts >= 100 us on the device
    assert peak.size > 1024
    assert dev.ops < 200  # a handful of sizes, a few products each


def test_a_launch_cost_above_the_size_threshold_still_reads_the_device():
    """A launch slower than 100 us makes every small product read >= 100 us; the rate's growth with size shows the
    host still sets it, so the search goes on until the device does."""
    dev = FakeStream(issue_s=400e-6)
    peak = measure_matmul_peak(dev.product, dev.events())
    assert peak.flops_per_s == pytest.approx(RATE, rel=0.03)


def test_the_search_stops_at_max_op_s():
    dev = FakeStream(rate=1e9)  # a slow device: 256^3 takes 34 ms, 512^3 268 ms
    peak = measure_matmul_peak(dev.product, dev.events(), max_op_s=0.1, min_gain=0.5)  # growth alone never stops it
    assert dev.largest == 512 and peak.flops_per_s == pytest.approx(1e9, rel=0.01)


def test_bad_search_settings_fail_early():
    with pytest.raises(ValueError, match="start"):
        measure_matmul_peak(FakeStream().product, FakeStream().events(), start=4096, max_size=1024)


def test_published_peaks_match_sxm_names_only():
    assert published_peak("NVIDIA H200", torch.bfloat16).flops_per_s == 989.4e12
    assert published_peak("NVIDIA H100 80GB HBM3", torch.bfloat16).flops_per_s == 989.4e12
    assert published_peak("NVIDIA A100-SXM4-80GB", torch.float16).flops_per_s == 312e12
    assert published_peak("NVIDIA H100 PCIe", torch.bfloat16) is None
    assert published_peak("NVIDIA H200", torch.float32) is None
    assert published_peak("NVIDIA GeForce RTX 4090", torch.bfloat16) is None


def test_this_cpu_peak_is_measured_in_fp32():
    peak = device_peak("cpu")
    assert peak.source == "measured" and peak.dtype == "float32"
    assert peak.flops_per_s == peak.measured_flops_per_s and 1e8 < peak.flops_per_s < 1e14
    assert peak.size >= 256
