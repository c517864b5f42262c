"""GPTQ checkpoints packed by the tests in GPTQModel's documented layout, with their dequantized
weights computed from that layout's formula (the oracle's weights), independent of blockdiff:

- qweight [in * bits / 32, out] int32: 32 / bits unsigned values of one output column per word,
  along the input dimension, lowest bits first;
- qzeros [groups, out * bits / 32] int32: the zero points, packed along the output dimension,
  stored minus one (checkpoint_format "gptq", GPTQModel's saved format);
- scales [groups, out] float16; g_idx [in] int32, the group of each input column.

W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o]. With desc_act the columns are taken
in a permuted order (GPTQ's activation order), so each group is a scattered set of columns.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

# the decoder layers' Linears GPTQModel quantizes (not the routers), with the experts split per expert
_LINEAR = re.compile(r"model\.decoder\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
_EXPERTS = re.compile(r"(model\.decoder\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)")


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed 32 / bits to an int32 word along `dim`, lowest bits first."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    words = sum(v[..., j] << (bits * j) for j in range(per))
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits, read as int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, desc_act: bool, seed: int):
    """-> (the checkpoint's tensors {qweight, qzeros, scales, g_idx}, the dequantized weight float32)."""
    out, inp = w.shape
    order = torch.randperm(inp, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // group_size).to(torch.int32)
    groups = -(-inp // group_size)
    top = 2**bits - 1
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].double()
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            scale = torch.maximum(-lo, hi) * 2 / top
            zero = torch.full((out,), (top + 1) // 2, dtype=torch.int64)
        else:
            scale = (hi - lo) / top
            zero = torch.round(-lo / scale).to(torch.int64).clamp(0, top)
        scales[g], zeros[g] = scale.clamp(min=1e-8).half().float(), zero
    s, z = scales[g_idx.long()].T, zeros[g_idx.long()].T  # [out, in]
    q = torch.clamp(torch.round(w.double() / s.double()) + z, 0, top).to(torch.int64)
    tensors = {
        "qweight": _pack(q.T, bits, 0),
        "qzeros": _pack(zeros - 1, bits, 1),
        "scales": scales.half(),
        "g_idx": g_idx,
    }
    return tensors, ((q - z).double() * s.double()).float()


def write_gptq(src: str, dst: str, bits: int, group_size: int, sym: bool, desc_act: bool) -> dict[str, torch.Tensor]:
    """The GPTQ checkpoint of `src` in `dst`; -> {each quantized Linear: its dequantized weight}."""
    shutil.copytree(src, dst)
    out, weights, seed = {}, {}, 0
    for k, v in load_file(os.path.join(src, "model.safetensors")).items():
        modules = []
        m = _EXPERTS.fullmatch(k)
        if m:
            for e, w in enumerate(v):
                halves = zip(("gate_proj", "up_proj"), w.chunk(2)) if m.group(2) == "gate_up_proj" else [("down_proj", w)]
                modules += [(f"{m.group(1)}.{e}.{proj}", half) for proj, half in halves]
        elif _LINEAR.fullmatch(k):
            modules = [(k.removesuffix(".weight"), v)]
        else:
            out[k] = v
        for name, w in modules:
            seed += 1
            tensors, weights[name] = quantize(w, bits, group_size, sym, desc_act, seed)
            out.update({f"{name}.{t}": x for t, x in tensors.items()})
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
        "lm_head": False, "checkpoint_format": "gptq", "pack_dtype": "int32", "true_sequential": True,
        "meta": {"quantizer": ["gptqmodel:5.0.0"]},
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return weights
