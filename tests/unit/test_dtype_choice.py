"""config.choose_dtype: a bfloat16 checkpoint runs bfloat16 on CPUs with AMX or AVX512-BF16 and float32
on other CPUs (dtype "auto"); the CPU's features are injected, so no test depends on this machine's."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from blockdiff.config import choose_dtype, parse_dtype
from blockdiff.ops.cpu import cpu_features
from blockdiff.engine.startup import kernels_line
from blockdiff.ops.matmul import dense_kernel, onednn_packed, widens
from blockdiff.model.registry import load_config

BIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                   "diffusiongemma-26b-a4b.json")


@pytest.fixture(scope="module")
def bf16_config():
    config = load_config(BIG)
    assert config.dtype == torch.bfloat16
    return config


@pytest.mark.parametrize("features,device,dtype", [
    (("amx_bf16",), "cpu", torch.bfloat16),
    (("avx512_bf16",), "cpu", torch.bfloat16),
    (("amx_bf16", "avx512_bf16"), "cpu", torch.bfloat16),
    ((), "cpu", torch.float32),  # an AMD (or older Intel) CPU without bfloat16 products
    (("avx2",), "cpu", torch.float32),
    ((), "cuda", torch.bfloat16),  # GPUs take the checkpoint's dtype
    ((), "cuda:1", torch.bfloat16),
])
def test_auto_on_a_bfloat16_checkpoint(bf16_config, features, device, dtype):
    chosen, why = choose_dtype("auto", bf16_config, device, features)
    assert chosen == dtype, why
    assert why


@pytest.mark.parametrize("features", [(), ("amx_bf16",)])
def test_an_asked_dtype_or_a_float32_checkpoint_is_kept(bf16_config, features):
    assert choose_dtype("bfloat16", bf16_config, "cpu", features)[0] == torch.bfloat16
    assert choose_dtype("float32", bf16_config, "cpu", features)[0] == torch.float32
    assert choose_dtype(torch.float16, bf16_config, "cpu", features)[0] == torch.float16
    fp32 = replace(bf16_config, dtype=torch.float32)
    assert choose_dtype("auto", fp32, "cpu", features)[0] == torch.float32
    with pytest.raises(ValueError, match="dtype must be"):
        choose_dtype("int8", bf16_config, "cpu", features)


def test_parse_dtype_asks_this_cpu(bf16_config):
    """parse_dtype is choose_dtype with this machine's features, whatever they are."""
    want = torch.bfloat16 if cpu_features() else torch.float32
    assert parse_dtype("auto", bf16_config, "cpu") == want


def test_the_startup_summary_names_the_kernels(bf16_config):
    line = kernels_line(bf16_config, torch.float32, "cpu", 1)
    assert "; experts grouped (" in line, line
    bf16 = kernels_line(bf16_config, torch.bfloat16, "cpu", 1)
    assert ("; experts batched (" if "amx_bf16" in cpu_features() else "; experts grouped (") in bf16, bf16
    # the dense products' kernel is the one `linear` takes for that dtype
    for dtype, text in ((torch.float32, line), (torch.bfloat16, bf16)):
        assert text.startswith(f"kernels: dense products {dense_kernel('cpu', dtype)}; "), text
        x = torch.ones(8, 16, dtype=dtype)
        if onednn_packed(x):
            assert "oneDNN" in text
        elif widens(x):
            assert "float32" in text
    assert kernels_line(bf16_config, torch.float16, "cpu", 1).startswith("kernels: dense products F.linear; ")
