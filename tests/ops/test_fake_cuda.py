"""The CUDA path of DiffusionGemma-26B-A4B, checked on this CPU with fake CUDA tensors (tests/fake_cuda.py).

The released config at its real widths and vocabulary (262,144), bfloat16, cut to two layers (its
first sliding layer and its first full one, so both attention kinds run), on a fake H200: the
static denoising step (what CUDA graphs capture) and an eager mixed step (a prompt chunk, a
canvas commit and canvases), at one rank and at the shard shapes of 2, 4 and 8 ranks. Fake
tensors hold no memory, so the whole 1.5 GB embedding costs nothing.

- device placement: a CPU tensor meeting a CUDA one raises FakeTensorDeviceMismatchError;
- no host sync in the static step: any `.item()`, `bool(t)`, `.tolist()` of device data raises
  DataDependentOutputException there, and so does a copy to the host (`NoHostReads`); set-up runs
  under the fake mode's own rule (no read of device data) and reads nothing either;
- the eager mixed step may read its canvases' finished flags on the host (that is its design):
  `HostReads` answers them and the test checks that none comes from the model's forward;
- the kernels' dtypes and layouts: every grouped product is checked as torch's CUDA kernel checks it.

Attention runs the device's backend, the Triton kernel on the fake H200 (its custom op's fake);
`test_static_step_with_each_attention_backend` runs the static step with each backend by name.

Tensor parallelism: the group is rank 0 of a torch FakeProcessGroup of N ranks, whose collectives
move nothing. Rank 0's shapes are every rank's (each holds 1/N of the heads, experts' widths and
vocabulary), so this checks the shard shapes, not the sharded arithmetic (tests/parallel/test_tensor_parallel.py
does that with gloo processes).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import replace

import pytest
import torch
from fake_cuda import GroupedCalls, HostReads, NoHostReads, fake_cuda, fake_group, fake_module
from helpers import new_requests, step_row, whole_tables
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorDeviceMismatchError

from blockdiff.config import ModelConfig
from blockdiff.model.registry import load_config
from blockdiff.diffusion.entropy_bound import EntropyBound, denoise_params
from blockdiff.model.attention import Row
from blockdiff.model.attention_backends import triton_paged
from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.model.quantize import FP8_DYNAMIC
from blockdiff.parallel.group import TPGroup
from blockdiff.sampling_params import REFERENCE_DEFAULTS, SamplingParams
from blockdiff.step import CacheConfig, NewRequests, StepPlan
from blockdiff.worker import canvas_step as canvas_step_module
from blockdiff.worker.canvas_step import CanvasSteps
from blockdiff.worker.model_runner import ModelRunner, RunnerSettings

BIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "diffusiongemma-26b-a4b.json")
BLOCK = 16
CACHE = CacheConfig(num_slots=4, num_blocks=4 * 2048 // BLOCK, block_size=BLOCK, max_model_len=2048)


def _config(quantized: bool = False) -> ModelConfig:
    config = load_config(BIG)
    g = config.arch
    keep = (0, next(i for i, spec in enumerate(g.layers) if not spec.sliding))
    g = replace(g, layers=tuple(g.layers[i] for i in keep), quantization=FP8_DYNAMIC if quantized else None)
    return replace(config, windows=tuple(config.windows[i] for i in keep), arch=g)


def _runner(tp: int, quantized: bool = False, attention_backend: str | None = None) -> ModelRunner:
    """Built inside fake_cuda(): the model made on meta and given fake CUDA storage, then the runner
    (attention_backend None: the device's, which is triton on the fake H200)."""
    config = _config(quantized)
    group = fake_group(tp) if tp > 1 else TPGroup()
    model = fake_module(lambda: DiffusionGemma(config, group, torch.bfloat16)).eval()
    return ModelRunner(model, CACHE, "cuda", EntropyBound(),
                       RunnerSettings(sampler_memory_gb=1.0, attention_backend=attention_backend))


def _blocks(slot: int, n: int) -> tuple[int, ...]:
    per_slot = CACHE.num_blocks // CACHE.num_slots
    return tuple(range(slot * per_slot, slot * per_slot + n))


def _params(n: int, cl: int):
    p = EntropyBound().resolve(SamplingParams(), REFERENCE_DEFAULTS)
    return denoise_params([16] * n, [p] * n, list(range(n)))


def _admitted(rows) -> NewRequests:
    """`rows`' requests as `_params` makes their parameters."""
    p = EntropyBound().resolve(SamplingParams(), REFERENCE_DEFAULTS)
    n = len({r.slot for r in rows})
    return new_requests(rows, [16] * n, [p] * n, list(range(n)))


def _canvas_rows(cl: int) -> list[Row]:
    """Three canvases (bucket 4: one padded), one past the sliding window, one with a short prefix."""
    return [Row(slot, start, cl, True, _blocks(slot, -(-start // BLOCK))) for slot, start in ((0, 1500), (1, 300), (2, 17))]


def _static_step(runner: ModelRunner):
    steps = CanvasSteps(runner.model, runner.sampler, runner.vocab, runner.kv, runner.geometry, runner.tables.tables, runner.state,
                        runner.requests, runner.device, compile=False, cuda_graphs=False)
    rows = _canvas_rows(runner.canvas_length)
    params = _params(len(rows), runner.canvas_length)
    runner.tables.apply(whole_tables(rows))
    runner.requests.admit(_admitted(rows))
    with NoHostReads():
        return steps(rows, params.options())


TP = [1, 2, 4, 8]


@pytest.mark.parametrize("tp", TP, ids=[f"tp{n}" for n in TP])
def test_static_step_on_a_fake_h200(tp):
    """One static step of three canvases: no device mismatch, no host read, the kernels' dtypes."""
    with fake_cuda((9, 0)), GroupedCalls().watch() as calls:
        runner = _runner(tp)
        inputs, out = _static_step(runner)
    model, cl, vocab = runner.model, runner.canvas_length, 262144
    assert all(p.is_cuda and (p.dtype == torch.bfloat16 or p.numel() == 0) for p in model.parameters())
    assert model.embed.weight.shape == (vocab // tp, 2816)
    assert all(k.dtype == torch.bfloat16 and k.is_cuda for kv in runner.kv for k in kv)
    canvas, soft = out.updates["canvas"], out.updates["soft"]
    assert canvas.shape == out.tokens.shape == (4, cl) and canvas.dtype == torch.long and canvas.is_cuda
    assert out.finished.dtype == torch.bool and out.updates["run"].dtype == torch.long
    assert soft.shape == (4, cl, 2816) and soft.dtype == torch.bfloat16 and out.logprob.dtype == torch.float32
    # two grouped products per layer, bfloat16 on the device, of one rank's 704 / tp columns
    assert calls.grouped == [((4 * cl * 8 + 128 * 7, 2816), (128, 2816, 2 * 704 // tp), torch.bfloat16),
                             ((4 * cl * 8 + 128 * 7, 704 // tp), (128, 704 // tp, 2816), torch.bfloat16)] * 2


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_static_step_with_each_attention_backend(backend):
    """The static step at 26B-A4B widths with each attention backend: no device mismatch, no host
    read; the Triton one runs its kernel (the custom op, through its fake) once per layer, reading
    the cache in place with the block tables."""
    calls = []
    original = triton_paged.paged_attention

    def counted(q, k, v, k_cache, v_cache, table, tiles, bounds, block_size):
        calls.append((q.shape, k_cache.shape, table.shape, tiles.dtype, bounds.shape))
        return original(q, k, v, k_cache, v_cache, table, tiles, bounds, block_size)

    with fake_cuda((9, 0)), pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_paged, "paged_attention", counted)
        runner = _runner(1, attention_backend=backend)
        _, out = _static_step(runner)
    cl = runner.canvas_length
    assert runner.geometry.backend == backend and out.tokens.shape == (4, cl) and out.tokens.is_cuda
    if backend == "reference":
        assert calls == []
    else:  # the sliding layer (16 heads of 256 over 8 KV heads), then the full one (512 over 2 KV heads)
        assert [(c[0], c[1][0], c[1][2]) for c in calls] == [((4 * cl, 16, 256), 8, 256), ((4 * cl, 16, 512), 2, 512)]
        assert all(c[3] == torch.int32 and c[4] == (4 * cl, 2) for c in calls)


@pytest.mark.parametrize("tp", [1, 8], ids=["tp1", "tp8"])
def test_fp8_static_step_on_a_fake_h200(tp):
    """The FP8-dynamic model (every linear FP8 but the router and LM head): the experts run as
    torch._scaled_grouped_mm, the other linears as torch._scaled_mm, with no host read."""
    with fake_cuda((9, 0)), GroupedCalls().watch() as calls:
        runner = _runner(tp, quantized=True)
        _, out = _static_step(runner)
    assert out.updates["soft"].dtype == torch.bfloat16 and len(calls.scaled) == 4 and not calls.grouped


def _reads_the_max(logits: torch.Tensor) -> None:
    if logits.amax().item() > 1e9:  # a host read that a real step could make
        raise AssertionError("not reached")


def _copies_the_max(logits: torch.Tensor) -> None:
    logits.amax().cpu()  # a device-to-host copy: a sync the fake mode itself lets pass


@pytest.mark.parametrize("sync", [_reads_the_max, _copies_the_max], ids=["item", "cpu"])
def test_a_host_sync_in_the_static_step_fails(sync):
    """The check can fail: an `.item()` or a `.cpu()` put into the step is a DataDependentOutputException."""
    with fake_cuda((9, 0)), pytest.MonkeyPatch.context() as patch:
        runner = _runner(1)
        original = runner.sampler.step

        def with_a_sync(logits, *args):
            sync(logits)
            return original(logits, *args)

        patch.setattr(runner.sampler, "step", with_a_sync)
        with pytest.raises(DataDependentOutputException):
            _static_step(runner)


def test_a_cpu_tensor_in_the_step_is_a_device_mismatch():
    """And a tensor made without its device is caught: here the canvases' starts."""
    original = canvas_step_module.canvas_metadata

    def on_the_cpu(starts, *args):
        return original(torch.zeros(starts.shape, dtype=starts.dtype), *args)

    with fake_cuda((9, 0)), pytest.MonkeyPatch.context() as patch:
        runner = _runner(1)
        patch.setattr(canvas_step_module, "canvas_metadata", on_the_cpu)
        with pytest.raises(FakeTensorDeviceMismatchError):
            _static_step(runner)


def test_a_cpu_tensor_in_the_triton_kernel_is_a_device_mismatch():
    """The kernel's fake checks its operands' devices too: here the per-query ranges made on the CPU."""
    original = triton_paged.canvas_metadata

    def ranges_on_the_cpu(*args):
        meta = original(*args)
        meta.sliding.bounds = torch.zeros(meta.sliding.bounds.shape, dtype=torch.int32)
        return meta

    with fake_cuda((9, 0)), pytest.MonkeyPatch.context() as patch:
        runner = _runner(1, attention_backend="triton")
        patch.setattr(triton_paged, "canvas_metadata", ranges_on_the_cpu)
        with pytest.raises(RuntimeError, match="device mismatch"):
            _static_step(runner)


@pytest.mark.parametrize("tp", TP, ids=[f"tp{n}" for n in TP])
def test_mixed_step_on_a_fake_h200(tp):
    """An eager step of a 300-token prompt chunk, a canvas commit and two canvases (one new): it runs
    on the device end to end; its host reads (the finished flags, answered "not finished") come from
    the runner after the sampler, never from the model's forward."""
    reads = HostReads()
    with fake_cuda((9, 0)):
        runner = _runner(tp)
        cl = runner.canvas_length
        rows = [Row(0, 0, 300, False, _blocks(0, -(-300 // BLOCK))),  # a prompt chunk
                Row(1, 500, cl, False, _blocks(1, -(-(500 + cl) // BLOCK))),  # a finished canvas, committed
                Row(2, 40, cl, True, _blocks(2, 3)),  # a new canvas
                Row(3, 1200, cl, True, _blocks(3, 75))]  # a canvas going on
        params = _params(len(rows), cl)
        plan = StepPlan([step_row(r) for r in rows], torch.randint(0, 262144, (300 + cl,)), [0],
                        torch.randint(0, 262144, (1, cl)), params.options(), top_logprobs=0, tables=whole_tables(rows),
                        new_requests=_admitted(rows), new_canvas_steps=[16], new_canvas_index=[0])
        with reads, _no_reads_inside(runner.model):
            out = runner.execute(plan)
    assert out.finished.shape == (2,) and out.tokens.shape == (2, cl) and out.logprob.shape == (2, cl)
    assert out.tokens.device.type == "cpu" and out.tokens.dtype == torch.long
    assert reads.reads, "the runner reads the finished flags: the answers were used"


class _no_reads_inside:
    """Fails the step if a host read happens while the model's forward runs."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        forward = self.model.forward

        def checked(*args, **kwargs):
            try:
                with NoHostReads():
                    return forward(*args, **kwargs)
            except DataDependentOutputException:
                raise AssertionError("a host read inside the model's forward:\n" + traceback.format_exc()) from None

        self.model.forward = checked
        return self

    def __exit__(self, *exc):
        del self.model.forward


@pytest.mark.parametrize("tp", [1, 2])
def test_fast_mode_step_on_a_fake_h200(tp):
    """A step of the fast denoising mode (docs/architecture.md, "Fewer forwards"): two canvases, one
    with half its positions settled by the last step (the runner's host copy of them, as that step
    read them back), beside a prompt chunk. Only the unsettled rows run, through the device's
    attention backend over the kept K/V, and nothing inside the model's forward reads the device."""
    reads = HostReads()
    fast = EntropyBound().resolve(SamplingParams(denoising_mode="fast"), REFERENCE_DEFAULTS)
    with fake_cuda((9, 0)):
        runner = _runner(tp)
        cl = runner.canvas_length
        rows = [Row(0, 0, 300, False, _blocks(0, -(-300 // BLOCK))),  # a prompt chunk
                Row(2, 40, cl, True, _blocks(2, 3)),  # a canvas going on, half settled
                Row(3, 1200, cl, True, _blocks(3, 75))]  # a canvas going on
        params = denoise_params([16, 16], [fast, fast], [0, 1])
        admitted = new_requests(rows, [16] * 3, [fast] * 3, [0, 1, 2])
        runner.settled[2, : cl // 2] = True
        plan = StepPlan([step_row(r) for r in rows], torch.randint(0, 262144, (300,)), [], torch.empty(0, cl, dtype=torch.long),
                        params.options(), tables=whole_tables(rows), new_requests=admitted)
        ran = []
        runner.model.self_conditioning.register_forward_pre_hook(lambda _, args: ran.append(args[0].shape[0]))
        with reads, _no_reads_inside(runner.model):
            out = runner.execute(plan)
    assert params.options()["fast"]
    assert out.rows_evaluated == [cl - cl // 2, cl] and ran == [cl - cl // 2 + cl]  # the decoder rows the model ran
    assert out.settled.shape == out.tokens.shape == (2, cl) and out.settled.device.type == "cpu"
