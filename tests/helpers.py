"""Test helpers: the transformers oracle and a one-sequence harness that drives our model
through its real cache and metadata."""

from __future__ import annotations

import os
import time

import torch

from blockdiff.step import CacheConfig, NewRequests, StepRow, TableDelta
from blockdiff.worker.kv_cache import allocate, geometry
from blockdiff.model.attention import Row, build_metadata
from blockdiff.model.interface import layer_kinds


# The device the parity and generation tests run our model and transformers on
# (scripts/device_check.sh sets cuda); the engine's own default, "auto", picks the same.
DEVICE = torch.device(os.environ.get("BLOCKDIFF_TEST_DEVICE", "cpu"))


def load_hf(path: str, dtype=torch.float32, **kwargs):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, **kwargs).to(DEVICE).eval()


class Oracle:
    """transformers' encoder and decoder, driven the way its generate() drives them."""

    def __init__(self, hf):
        from transformers.cache_utils import DynamicCache

        self.hf = hf
        self.cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        self.length = 0

    @torch.no_grad()
    def encode(self, ids: list[int], pixels: dict | None = None, image_token_id: int | None = None) -> None:
        """`pixels`: the image processor's output for the `image_token_id` placeholders among `ids`;
        their tokens then attend to each other (the mask generate() builds from mm_token_type_ids)."""
        n = len(ids)
        pos = torch.arange(self.length, self.length + n, device=DEVICE)[None]
        input_ids = torch.tensor([ids], device=DEVICE)
        extra = {}
        if pixels is not None:
            extra = dict(pixel_values=pixels["pixel_values"].to(DEVICE), image_position_ids=pixels["image_position_ids"].to(DEVICE))
            extra["attention_mask"] = self.hf.model.encoder.create_masks_for_generate(
                config=self.hf.config, inputs_embeds=torch.empty(1, n, 0, device=DEVICE),
                attention_mask=torch.ones(1, self.length + n, dtype=torch.bool, device=DEVICE), past_key_values=self.cache,
                position_ids=pos, mm_token_type_ids=(input_ids == image_token_id).long(),
            )
        self.hf.model.encoder(input_ids=input_ids, past_key_values=self.cache, position_ids=pos, **extra)
        self.length += n

    @torch.no_grad()
    def decode(self, canvas: list[int], sc_logits: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(self.length, self.length + len(canvas), device=DEVICE)[None]
        out = self.hf(
            decoder_input_ids=torch.tensor([canvas], device=DEVICE),
            past_key_values=self.cache,
            decoder_position_ids=pos,
            self_conditioning_logits=None if sc_logits is None else sc_logits[None],
        )
        return out.logits[0]


def hf_generate_with_draft(hf, prompt: list[int], draft: list[int], **kwargs) -> list[int]:
    """transformers' generate with canvas k seeded from draft[k*CL:(k+1)*CL] (noise past the draft)."""
    cl = hf.config.canvas_length
    original = hf._prepare_denoiser_inputs
    canvas = [0]

    def seeded(*args, **kw):
        chunk = draft[canvas[0] * cl : (canvas[0] + 1) * cl]
        if len(chunk) == cl:
            kw["model_kwargs"]["decoder_input_ids"] = torch.tensor([chunk], device=hf.device)
        canvas[0] += 1
        return original(*args, **kw)

    hf._prepare_denoiser_inputs = seeded
    try:
        out = hf.generate(torch.tensor([prompt], device=hf.device), **kwargs)
    finally:
        del hf._prepare_denoiser_inputs
    return out.sequences[0, len(prompt) :].tolist()


class Harness:
    """One sequence through our model: encode() appends to the cache, decode() reads it."""

    def __init__(self, model, max_len: int = 256, block_size: int = 8):
        self.model = model
        cfg = CacheConfig(num_slots=1, num_blocks=-(-max_len // block_size), block_size=block_size, max_model_len=max_len)
        self.kv = allocate(model, cfg, DEVICE)
        self.geo = geometry(model, cfg)
        self.blocks = tuple(range(cfg.num_blocks))
        self.length = 0

    @torch.no_grad()
    def encode(self, ids: list[int], images=None, bidirectional: tuple[tuple[int, int], ...] = ()) -> None:
        """`images`: blockdiff.model.vision.ImageInputs for the placeholders among `ids`;
        `bidirectional`: their [start, end) position spans, as the engine gives them."""
        row = Row(0, self.length, len(ids), False, self.blocks, bidirectional=bidirectional)
        meta = build_metadata([row], self.geo, layer_kinds(self.model), DEVICE)
        self.model(_padded(ids, meta), meta, self.kv, images=images)
        self.length += len(ids)

    @torch.no_grad()
    def decode(self, canvas: list[int], soft: torch.Tensor | None = None) -> torch.Tensor:
        meta = build_metadata([Row(0, self.length, len(canvas), True, self.blocks)], self.geo, layer_kinds(self.model), DEVICE)
        return self.model(_padded(canvas, meta), meta, self.kv, soft)


def _padded(ids: list[int], meta) -> torch.Tensor:
    return torch.tensor(ids + [0] * (meta.num_tokens - len(ids)), device=DEVICE)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def whole_tables(rows) -> TableDelta:
    """The rows' own block tables (`Row.blocks`, `Row.sliding_blocks`) written whole: a plan's
    TableDelta built by hand, outside an engine."""
    by_slot = {r.slot: r for r in rows}
    full = [(s, i, b) for s, r in by_slot.items() for i, b in enumerate(r.blocks)]
    sliding = [(s, i, b) for s, r in by_slot.items()
               for i, b in enumerate(r.blocks if r.sliding_blocks is None else r.sliding_blocks)]
    return TableDelta.of(list(by_slot), full, sliding)


def step_row(row) -> StepRow:
    return StepRow(row.slot, row.length, row.decoder, row.bidirectional)


def new_requests(rows, steps: list[int], params: list, seeds: list[int]) -> NewRequests:
    """The requests of `rows` (one per slot, in order of first appearance) from their rows' starts,
    their first canvases at steps `steps`, with entropy-bound SamplingParams `params` (resolved) and
    `seeds`, one per slot."""
    from blockdiff.diffusion.entropy_bound import EntropyBound

    starts = {r.slot: r.start for r in rows}
    return NewRequests(list(starts), list(starts.values()), seeds, steps, [0] * len(starts),
                       [EntropyBound().canvas_values(p) for p in params])


def import_test_file(path: str):
    """The test module at `path` under tests/ (as "parallel/test_tensor_parallel.py"), for the pieces
    another folder's tests share with it: imported once, under its basename, as pytest itself
    imports it (test basenames are unique across the folders)."""
    import importlib.util
    import sys

    name = os.path.splitext(os.path.basename(path))[0]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def wait_until(done, timeout: float, every: float = 0.05) -> bool:
    """Polls `done()` until it holds or `timeout` seconds pass; -> its last answer."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(every)
    return done()


def vllm_penalized(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float = 1.0,
                   presence: float = 0.0, frequency: float = 0.0, bias: dict[int, float] | None = None) -> torch.Tensor:
    """vLLM's v1 sampler's logits processing on logits [..., V] in float64: logit_bias added, then
    the repetition penalty over the prompt's and the output's tokens, then the frequency and
    presence penalties over the output's (vllm/model_executor/layers/utils.py apply_penalties)."""
    v = logits.shape[-1]
    x = logits.double().clone()
    for t, b in (bias or {}).items():
        x[..., t] += b
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=v).double()
    seen = torch.zeros(v, dtype=torch.bool)
    seen[torch.tensor(prompt, dtype=torch.long)] = True
    seen |= counts > 0
    x = torch.where(seen & (x > 0), x / repetition, torch.where(seen, x * repetition, x))
    return x - frequency * counts - presence * (counts > 0).double()


def step_until_done(engine, prompt: list[int], requests: dict) -> dict[str, list]:
    """Adds each named request (name -> SamplingParams) with `prompt`, then steps `engine` until every
    one ends; -> each request's outputs in the order they came."""
    for name, params in requests.items():
        engine.add_request(prompt, params, request_id=name)
    outputs = {name: [] for name in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs
