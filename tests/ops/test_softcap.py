"""`ops/softcap.py`: the final logits' soft cap, in place."""

from __future__ import annotations

import torch

from blockdiff.ops.softcap import softcap_


def test_the_cap_is_tanh_and_a_logit_comes_out_the_same_wherever_it_sits():
    x = torch.randn(5, 1001, generator=torch.Generator().manual_seed(0)) * 60
    got = softcap_(x.clone(), 30.0)
    torch.testing.assert_close(got, 30 * torch.tanh(x / 30), atol=1e-5, rtol=0)
    assert got.abs().max() <= 30
    # a row alone, shifted off the vector width, gives the same bits (batch invariance)
    for i in range(5):
        assert torch.equal(softcap_(x[i, 3:].clone(), 30.0), got[i, 3:])
