"""blockdiff/ops/kernels.py: one decision of the experts' kernel and of compile / CUDA graphs, from the
device type, compute capability, dtype and shapes, and the experts taking it on a fake CUDA device."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from fake_cuda import GroupedCalls, fake_cuda, fake_group, fake_module
from torch._subclasses.fake_tensor import DataDependentOutputException

from blockdiff.model.gemma_config import GemmaConfig
from blockdiff.model.registry import load_config
from blockdiff.ops.kernels import (
    BATCHED, FP8, GROUPED, PER_EXPERT, SCALED_GROUPED, ExpertShape, Ops, Target, batched_rows, expert_kernel, padded,
    static_kernel, step_modes, transposed_layout,
)
from blockdiff.parallel.group import TPGroup
from blockdiff.model.moe import Experts, combine_top_k
from blockdiff.parallel.quantization.fp8 import Fp8Config, Fp8ExpertsMethod

BIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "diffusiongemma-26b-a4b.json")
CPU, H200, B200, A100, L40, RTX5090 = (Target("cpu"), Target("cuda", (9, 0)), Target("cuda", (10, 0)),
                                       Target("cuda", (8, 0)), Target("cuda", (8, 9)), Target("cuda", (12, 0)))
ALL_OPS = Ops(grouped_mm=True, scaled_grouped_mm=True, cpu_grouped_mm=(torch.float32, torch.bfloat16),
              cpu_bf16_grouped=False)
# The 26B-A4B experts on one rank: hidden 2816, width 704.
BF16_26B = ExpertShape(2816, 704, torch.bfloat16)
FP8_26B = ExpertShape(2816, 704, FP8, "dynamic")


def test_padded_widths_are_whole_16_byte_rows():
    assert [padded(n, torch.float32) for n in (10, 12, 18, 50)] == [12, 12, 20, 52]
    assert [padded(n, torch.bfloat16) for n in (10, 12, 24, 88)] == [16, 16, 24, 88]
    assert [padded(n, FP8) for n in (88, 176, 704, 235)] == [96, 176, 704, 240]


@pytest.mark.parametrize("where,dtype,shape,kernel", [
    (CPU, torch.float32, ExpertShape(2816, 704, torch.float32), GROUPED),
    (CPU, torch.bfloat16, BF16_26B, GROUPED),
    (H200, torch.bfloat16, BF16_26B, GROUPED),
    (B200, torch.bfloat16, BF16_26B, GROUPED),
    # float32 on CUDA: torch's kernel loops over groups with the offsets copied to the host
    (H200, torch.float32, ExpertShape(2816, 704, torch.float32), PER_EXPERT),
    # no-sync grouped kernels exist for compute capability 9.x and 10.x only
    (A100, torch.bfloat16, BF16_26B, PER_EXPERT),
    (RTX5090, torch.bfloat16, BF16_26B, PER_EXPERT),
    # unpadded widths that miss 16-byte rows: 10 float32 columns (moe 20 at TP 2), 12 bfloat16 ones
    (CPU, torch.float32, ExpertShape(48, 10, torch.float32), PER_EXPERT),
    (H200, torch.bfloat16, ExpertShape(2816, 12, torch.bfloat16), PER_EXPERT),
    (CPU, torch.float32, ExpertShape(50, 20, torch.float32), PER_EXPERT),
    # FP8: one scaled grouped product on Hopper and Blackwell, with quantized bfloat16 activations
    (H200, torch.bfloat16, FP8_26B, SCALED_GROUPED),
    (H200, torch.bfloat16, replace(FP8_26B, activations="static"), SCALED_GROUPED),
    (B200, torch.bfloat16, FP8_26B, SCALED_GROUPED),
    (H200, torch.bfloat16, replace(FP8_26B, activations=None), PER_EXPERT),
    (H200, torch.float32, FP8_26B, PER_EXPERT),
    (L40, torch.bfloat16, FP8_26B, PER_EXPERT),
    (CPU, torch.bfloat16, FP8_26B, PER_EXPERT),
    (H200, torch.bfloat16, ExpertShape(2816, 88, FP8, "dynamic"), PER_EXPERT),  # 704 / 8 ranks, unpadded
    (H200, torch.bfloat16, ExpertShape(2816, padded(88, FP8), FP8, "dynamic"), SCALED_GROUPED),
])
def test_expert_kernel(where, dtype, shape, kernel):
    assert expert_kernel(where, dtype, shape, ALL_OPS)[0] == kernel


def test_the_per_expert_loop_is_kept_only_where_the_grouped_op_is_missing():
    no_scaled = replace(ALL_OPS, scaled_grouped_mm=False)
    no_grouped = Ops(grouped_mm=False, scaled_grouped_mm=False, cpu_grouped_mm=())
    assert expert_kernel(H200, torch.bfloat16, FP8_26B, no_scaled)[0] == PER_EXPERT
    assert expert_kernel(H200, torch.bfloat16, BF16_26B, no_scaled)[0] == GROUPED
    assert expert_kernel(H200, torch.bfloat16, BF16_26B, no_grouped)[0] == PER_EXPERT
    assert expert_kernel(CPU, torch.float32, ExpertShape(64, 32, torch.float32), no_grouped)[0] == PER_EXPERT


@pytest.mark.parametrize("where,dtype,shape,asked,modes", [
    # (compile, cuda_graphs) asked -> (compile, cuda_graphs) run; compile None: the device's default
    (CPU, torch.float32, ExpertShape(64, 32, torch.float32), (None, False), (False, False)),
    (CPU, torch.float32, ExpertShape(64, 32, torch.float32), (True, False), (True, False)),
    (H200, torch.bfloat16, BF16_26B, (None, True), (False, True)),  # graphs without compile by default
    (H200, torch.bfloat16, BF16_26B, (True, True), (True, True)),
    (H200, torch.bfloat16, BF16_26B, (False, True), (False, True)),
    (H200, torch.bfloat16, FP8_26B, (False, True), (False, True)),
    # a step whose experts read group sizes on the host is never captured nor compiled by default
    (H200, torch.float32, ExpertShape(2816, 704, torch.float32), (None, True), (False, False)),
    (A100, torch.bfloat16, BF16_26B, (None, True), (False, False)),
    (L40, torch.bfloat16, FP8_26B, (False, True), (False, False)),
    (CPU, torch.float32, ExpertShape(50, 20, torch.float32), (None, False), (False, False)),
])
def test_step_modes(where, dtype, shape, asked, modes):
    plan = step_modes(where, static_kernel(expert_kernel(where, dtype, shape, ALL_OPS)[0]), *asked)
    assert (plan.compile, plan.cuda_graphs) == modes, plan


def test_compile_of_a_step_with_host_syncs_is_refused():
    with pytest.raises(ValueError, match="static shapes"):
        shape = ExpertShape(2816, 704, torch.float32)
        step_modes(H200, static_kernel(expert_kernel(H200, torch.float32, shape, ALL_OPS)[0]), True, True)


def _config(**changes) -> GemmaConfig:
    """The 26B-A4B's own config (what its experts read)."""
    return replace(load_config(BIG).arch, **changes)


@pytest.mark.parametrize("capability,dtype,kernel", [((9, 0), torch.bfloat16, GROUPED), ((9, 0), torch.float32, PER_EXPERT),
                                                     ((8, 0), torch.bfloat16, PER_EXPERT)])
@pytest.mark.parametrize("ranks", [1, 8])
def test_experts_on_a_fake_gpu_take_the_chosen_kernel(capability, dtype, kernel, ranks):
    """The 26B-A4B experts (one rank's shard of 1 or 8) on a fake GPU: where the grouped kernel is
    chosen the forward calls it with operands the CUDA kernel accepts and reads nothing on the host;
    elsewhere the per-expert path reads the group sizes, which the fake device reports as a host sync."""
    config = _config()
    with fake_cuda(capability), GroupedCalls().watch() as calls:
        experts = fake_module(lambda: Experts(config, fake_group(ranks), dtype))
        x = torch.randn(512, config.hidden_size, dtype=dtype, device="cuda")
        weights = torch.rand(512, 8, device="cuda")
        index = torch.randint(0, 128, (512, 8), device="cuda")
        assert experts.kernel(x) == kernel
        if kernel == GROUPED:
            out = experts(x, weights, index)
            assert out.device.type == "cuda" and out.dtype == dtype and out.shape == x.shape
            assert [a[1] for a in calls.grouped] == [(128, 2816, 2 * 704 // ranks), (128, 704 // ranks, 2816)]
        else:
            with pytest.raises(DataDependentOutputException):
                experts(x, weights, index)


@pytest.mark.parametrize("ranks", [1, 8])
def test_expert_lora_is_grouped_products_on_hopper(ranks):
    """The 26B-A4B experts with LoRA pools (4 slots of rank 16) on a fake H200 in bfloat16: the
    base products and each pool's shrink and expand are grouped calls the CUDA kernel accepts,
    with no host read."""
    from blockdiff.model.lora_layers import ExpertsWithLoRA, LoRABatch, LoRAMapping

    config = _config()
    with fake_cuda((9, 0)), GroupedCalls().watch() as calls:
        mapping = LoRAMapping(4, 16, torch.bfloat16)
        experts = ExpertsWithLoRA(fake_module(lambda: Experts(config, fake_group(ranks), torch.bfloat16)), mapping)
        x = torch.randn(512, config.hidden_size, dtype=torch.bfloat16, device="cuda")
        weights = torch.rand(512, 8, device="cuda")
        index = torch.randint(0, 128, (512, 8), device="cuda")
        mapping.batch = LoRABatch(torch.randint(-1, 4, (512,), device="cuda"), 200, experts=True)
        out = experts(x, weights, index)
        assert out.device.type == "cuda" and out.dtype == torch.bfloat16 and out.shape == x.shape
        w, c = 2 * 704 // ranks, 2 * 4 * 16  # gate_up's local rows; the pools' columns (2 modes x 4 slots x 16)
        assert [a[1] for a in calls.grouped] == [(128, 2816, w), (128, 2816, c), (128, c, w),
                                                 (128, 704 // ranks, 2816), (128, 704 // ranks, c), (128, c, 2816)]


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_fp8_experts_are_one_scaled_grouped_product_on_hopper(activations, ranks):
    """FP8 experts of the 26B-A4B on a fake H200: two torch._scaled_grouped_mm calls, whose operands
    pass the CUDA kernel's checks (FP8 row-major activations and column-major weights, dimensions
    divisible by 16, float32 row-wise scales, int32 offsets on the device), bfloat16 out, no host
    read. At eight ranks the 88 columns of each expert are padded to 96."""
    config = _config()
    quant = Fp8Config("channel", activations, ("Linear",), ())
    with fake_cuda((9, 0)), GroupedCalls().watch() as calls:
        experts = fake_module(lambda: Experts(config, fake_group(ranks), torch.bfloat16, Fp8ExpertsMethod(quant)))
        x = torch.randn(512, config.hidden_size, dtype=torch.bfloat16, device="cuda")
        out = experts(x, torch.rand(512, 8, device="cuda"), torch.randint(0, 128, (512, 8), device="cuda"))
        assert out.dtype == torch.bfloat16 and out.shape == x.shape and out.is_cuda
    width = padded(704 // ranks, FP8)
    assert experts.local == width and (ranks < 8 or width == 96)
    assert [c[1] for c in calls.scaled] == [(128, 2816, 2 * width), (128, width, 2816)]
    assert not calls.grouped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_moe_combine_adds_what_index_add_adds_on_the_cpu(dtype):
    """The fixed-order combine of each token's top-k expert outputs (no atomics on CUDA) gives the
    bits of the index_add_ it replaced, on the CPU, where that op adds in a fixed order too."""
    g = torch.Generator().manual_seed(0)
    n, k, experts, hidden = 300, 8, 128, 96
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    order = index.reshape(-1).argsort(stable=True)
    y = (torch.randn(n * k, hidden, generator=g) * 3).to(dtype)
    want = torch.zeros(n, hidden, dtype=dtype).index_add_(0, order // k, y)
    assert torch.equal(combine_top_k(y, order, n, k), want)


AMX, AVX512_BF16 = Target("cpu", features=frozenset({"amx_bf16"})), Target("cpu", features=frozenset({"avx512_bf16"}))


@pytest.mark.parametrize("where,dtype,shape,kernel", [
    (AMX, torch.bfloat16, BF16_26B, BATCHED),
    (AVX512_BF16, torch.bfloat16, BF16_26B, GROUPED),  # measured no faster batched without AMX
    (CPU, torch.bfloat16, BF16_26B, GROUPED),  # an AMD CPU without AVX512-BF16: the grouped fallback
    (AMX, torch.float32, ExpertShape(2816, 704, torch.float32), GROUPED),
    (AMX, torch.bfloat16, FP8_26B, PER_EXPERT),
    (AMX, torch.bfloat16, ExpertShape(50, 20, torch.bfloat16), PER_EXPERT),  # unpadded widths
])
def test_bfloat16_cpus_take_the_batched_kernel(where, dtype, shape, kernel):
    """The batched products on CPUs with AMX (the features are injected: no test depends on this
    machine's CPU), the grouped ones elsewhere; a batched step stays static."""
    assert expert_kernel(where, dtype, shape, ALL_OPS)[0] == kernel
    assert static_kernel(BATCHED)


def test_avx512_bf16_cpus_take_blockdiffs_grouped_kernel_in_the_checkpoint_layout():
    """Where blockdiff's AVX512-BF16 kernel is built (injected here), bfloat16 experts on such a CPU
    without AMX take it, still a static grouped step, and keep the checkpoint's [out, in] layout it
    reads; AMX keeps its batched products and float32 torch's grouped kernel in [in, out]."""
    ours = replace(ALL_OPS, cpu_bf16_grouped=True)
    kernel, why = expert_kernel(AVX512_BF16, torch.bfloat16, BF16_26B, ours)
    assert kernel == GROUPED and "AVX512-BF16" in why
    assert not transposed_layout(AVX512_BF16, torch.bfloat16, BF16_26B, ours)
    assert transposed_layout(AVX512_BF16, torch.bfloat16, BF16_26B, ALL_OPS)  # torch's kernel reads [in, out]
    assert "AVX512-BF16" not in expert_kernel(AVX512_BF16, torch.bfloat16, BF16_26B, ALL_OPS)[1]
    both = Target("cpu", features=frozenset({"amx_bf16", "avx512_bf16"}))
    assert expert_kernel(both, torch.bfloat16, BF16_26B, ours)[0] == BATCHED
    fp32 = ExpertShape(2816, 704, torch.float32)
    assert "AVX512-BF16" not in expert_kernel(AVX512_BF16, torch.float32, fp32, ours)[1]
    assert transposed_layout(AVX512_BF16, torch.float32, fp32, ours)


def test_batched_rows_pad_to_tiles_unless_padding_doubles_the_rows():
    assert batched_rows(12, 64 * 4, 32) == 16  # 512 rows for 256 pairs: 2x, allowed
    assert batched_rows(17, 64 * 4, 32) is None  # 1024 rows for 256 pairs
    assert batched_rows(43, 256 * 4, 32) == 48
    assert batched_rows(1, 4, 4) is None  # 64 rows for 4 pairs
    assert batched_rows(16, 128, 8) == 16


@pytest.mark.parametrize("hidden,width", [(64, 32), (50, 20)])
def test_batched_experts_equal_the_grouped_ones(hidden, width):
    """The experts through one torch.bmm per projection give what the grouped products give (the
    same oneDNN products per row; bfloat16 rounding may differ by a last bit)."""
    torch.manual_seed(0)
    config = _config(num_experts=8, top_k_experts=2, hidden_size=hidden, moe_intermediate_size=width)
    experts = Experts(config, TPGroup(), torch.bfloat16)
    experts.gate_up.data.normal_(0, 0.1)
    experts.down.data.normal_(0, 0.1)
    experts.zero_padding()
    x = torch.randn(40, hidden, dtype=torch.bfloat16)
    token = torch.randperm(40)
    index = torch.stack([token % 8, (token + 3) % 8], dim=1)  # 10 tokens per expert, in no order
    assert batched_rows(int(torch.bincount(index.reshape(-1)).max()), 80, 8) is not None  # not the fallback
    weights = torch.rand(40, 2)
    outs = {}
    with torch.inference_mode():
        for kernel in (GROUPED, BATCHED):
            experts.kernel = lambda x, kernel=kernel: kernel
            outs[kernel] = experts(x, weights, index)
    assert outs[BATCHED].dtype == torch.bfloat16 and outs[BATCHED].shape == x.shape
    torch.testing.assert_close(outs[BATCHED], outs[GROUPED], rtol=1e-2, atol=1e-2)
