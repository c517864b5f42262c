"""The sampler's weights exp(y), 0 below the floor: the same bits as exp with a kept-mask, made with no
temporary of the weights' size (ops/sampler_weights.py)."""

from __future__ import annotations

import math

import torch
from torch.profiler import ProfilerActivity, profile

from blockdiff.ops.sampler_weights import EXP_FLOOR, weights_exp

_BELOW = float(torch.tensor(EXP_FLOOR).nextafter(torch.tensor(-math.inf)))
_ABOVE = float(torch.tensor(EXP_FLOOR).nextafter(torch.tensor(0.0)))


def _shifted() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    y = torch.empty(64, 1000).uniform_(-200, 0, generator=g)
    y[0, :8] = torch.tensor([EXP_FLOOR, _BELOW, _ABOVE, -math.inf, -1e30, 0.0, -87.3, -103.9])
    return y


def test_the_weights_are_exp_and_zero_below_the_floor_to_the_bit():
    y = _shifted()
    want = torch.where(y >= EXP_FLOOR, y.exp(), 0.0)
    assert torch.equal(weights_exp(y), want)
    assert torch.equal(weights_exp(y, out=torch.empty_like(y)), want)
    assert torch.equal(weights_exp(y, out=y), want)  # in place
    assert weights_exp(torch.tensor([EXP_FLOOR])).item() > 0 and weights_exp(torch.tensor([_BELOW])).item() == 0


def test_weights_into_a_buffer_allocate_nothing():
    """A mask of y and its float32 cast for a multiply were 5 bytes per weight beside the sampler's tile."""
    y, out = _shifted(), torch.empty(64, 1000)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        weights_exp(y, out=out)
    allocated = sum(max(0, e.self_cpu_memory_usage) for e in prof.key_averages())
    assert allocated == 0, [(e.key, e.self_cpu_memory_usage) for e in prof.key_averages()]
