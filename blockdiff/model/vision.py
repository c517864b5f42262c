"""The Gemma 4 vision encoder and the projector that turns its output into prompt embeddings.

An image (or a video frame, encoded as an image) arrives as patches [patches, 3 * patch_size**2] in
[0, 1] with their (x, y) grid positions [patches, 2] (blockdiff/multimodal makes both). The
encoder is a bidirectional transformer
over the patches of one image with 2-D ("axial") rotary positions; its output is average-pooled over
pooling_kernel_size**2 neighbouring patches into soft tokens, scaled by sqrt(hidden), optionally
standardised, and projected to the text model's hidden size. Each soft token then replaces one
image placeholder token of the prompt.

Images are encoded one at a time, without the padding to a fixed patch count that the reference
batches with: padding patches are masked out of attention and pooling there, so a real patch's
result is the same.

Under tensor parallelism every rank holds the whole tower and encodes every image: the tower is
small beside the text model (docs/images.md) and a replicated one needs no collective.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.model.gemma_config import VisionConfig
from blockdiff.model.layers import RMSNorm, activation
from blockdiff.step import ImageInputs

PREFIX = "model.encoder.vision_tower."
PROJECTOR_PREFIX = "model.encoder.embed_vision."


class ClippableLinear(nn.Module):
    """A bias-free linear layer that may clamp its input and output to bounds stored beside it."""

    def __init__(self, d_in: int, d_out: int, clipped: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in, dtype=dtype), requires_grad=False)
        self.bounds = None
        if clipped:
            # input_min, input_max, output_min, output_max (unbounded unless the checkpoint says so)
            inf = float("inf")
            self.bounds = nn.Parameter(torch.tensor([-inf, inf, -inf, inf], dtype=dtype), requires_grad=False)
            self.bounds.weight_loader = _bound_loader
            self.bounds.num_parts = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bounds is None:
            return F.linear(x, self.weight)
        b = self.bounds
        return F.linear(x.clamp(b[0], b[1]), self.weight).clamp(b[2], b[3])


def _bound_loader(param: torch.Tensor, source, name: str, part: int) -> None:
    shape = source.get_shape()
    if shape:
        raise ValueError(f"{name}: a clamp bound must be a scalar, got shape {tuple(shape)}")
    param.data[part] = source[()]


def axial_cos_sin(cfg: VisionConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [patches, head_dim] of 2-D RoPE: the first half of a head rotates with the x
    position, the second half with the y position, both with the same frequencies."""
    quarter = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=positions.device) / quarter))
    freqs = positions[..., None].float() * inv_freq  # [patches, 2, head_dim / 4]
    fx, fy = freqs[:, 0], freqs[:, 1]
    angles = torch.cat((fx, fx, fy, fy), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Standard rotate-half RoPE on each half of the head: x [patches, heads, head_dim]."""
    out = []
    half = x.shape[-1] // 2
    for part, c, s in zip(x.split(half, -1), cos.split(half, -1), sin.split(half, -1)):
        quarter = half // 2
        rotated = torch.cat((-part[..., quarter:], part[..., :quarter]), dim=-1)
        out.append(part * c[:, None] + rotated * s[:, None])
    return torch.cat(out, dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        hd, clip = cfg.head_dim, cfg.clipped_linears
        self.cfg = cfg
        self.q_proj = ClippableLinear(cfg.hidden_size, cfg.num_heads * hd, clip, dtype)
        self.k_proj = ClippableLinear(cfg.hidden_size, cfg.num_kv_heads * hd, clip, dtype)
        self.v_proj = ClippableLinear(cfg.hidden_size, cfg.num_kv_heads * hd, clip, dtype)
        self.o_proj = ClippableLinear(cfg.num_heads * hd, cfg.hidden_size, clip, dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.v_norm = RMSNorm(hd, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, hd = x.shape[0], self.cfg.head_dim
        q = _rotate(self.q_norm(self.q_proj(x).view(n, -1, hd)), cos, sin)
        k = _rotate(self.k_norm(self.k_proj(x).view(n, -1, hd)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(n, -1, hd))
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # Every patch of the image sees every other one; attention scaling is 1 (q/k are normed).
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        h, i, clip = cfg.hidden_size, cfg.intermediate_size, cfg.clipped_linears
        self.gate_proj = ClippableLinear(h, i, clip, dtype)
        self.up_proj = ClippableLinear(h, i, clip, dtype)
        self.down_proj = ClippableLinear(i, h, clip, dtype)
        self.act = activation(cfg.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.self_attn = VisionAttention(cfg, dtype)
        self.mlp = VisionMLP(cfg, dtype)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    """Patches of one image -> its soft tokens in the text model's hidden size."""

    def __init__(self, cfg: VisionConfig, text_hidden: int, text_eps: float, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        h = cfg.hidden_size
        self.input_proj = nn.Parameter(torch.empty(h, 3 * cfg.patch_size**2, dtype=dtype), requires_grad=False)
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, cfg.position_embedding_size, h, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(VisionLayer(cfg, dtype) for _ in range(cfg.num_layers))
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.zeros(h, dtype=dtype), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        # embed_vision: an unscaled RMSNorm (with the vision eps) and a projection to the text width
        self.pre_projection_norm = RMSNorm(h, cfg.rms_norm_eps, with_scale=False)
        self.projection = nn.Parameter(torch.empty(text_hidden, h, dtype=dtype), requires_grad=False)

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """pixels [patches, 3 * patch**2] in [0, 1], positions [patches, 2] -> [soft tokens, text hidden]."""
        cfg = self.cfg
        x = F.linear((2 * (pixels - 0.5)).to(self.dtype), self.input_proj)
        table = self.position_embedding_table
        x = x + (F.embedding(positions[:, 0], table[0]) + F.embedding(positions[:, 1], table[1]))
        cos, sin = axial_cos_sin(cfg, positions, self.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        pooled = self._pool(x, positions).float() * cfg.hidden_size**0.5
        if cfg.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return F.linear(self.pre_projection_norm(pooled.to(self.dtype)), self.projection)

    def _pool(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Average of each k x k square of patches, squares in row-major order."""
        k = self.cfg.pooling_kernel_size
        if k == 1:
            return x
        tokens = x.shape[0] // (k * k)
        width = int(positions[:, 0].max()) + 1
        square = (positions[:, 0] // k) + (width // k) * (positions[:, 1] // k)
        weights = F.one_hot(square, tokens).float() / (k * k)
        return (weights.t() @ x.float()).to(x.dtype)

    def soft_tokens(self, images: ImageInputs) -> torch.Tensor:
        """The soft tokens `images.feature_rows` selects, [n, text hidden]."""
        feats = [self(p, pos) for p, pos in zip(images.pixel_values, images.position_ids)]
        return torch.cat(feats).index_select(0, images.feature_rows)


# checkpoint name below PREFIX / PROJECTOR_PREFIX -> our parameter below "vision." (and a part of it)
_CLIP_PARTS = {"input_min": 0, "input_max": 1, "output_min": 2, "output_max": 3}


def map_vision_name(name: str) -> tuple[str, int | None] | None:
    """A checkpoint tensor of the vision tower or projector -> (parameter of `VisionEncoder` with the
    "vision." prefix, element of it for a clamp bound), or None when the name is not one."""
    if name.startswith(PROJECTOR_PREFIX):
        rest = name[len(PROJECTOR_PREFIX) :]
        return ("vision.projection", None) if rest == "embedding_projection.weight" else None
    if not name.startswith(PREFIX):
        return None
    rest = name[len(PREFIX) :]
    if rest == "patch_embedder.input_proj.weight":
        return "vision.input_proj", None
    if rest in ("patch_embedder.position_embedding_table", "std_bias", "std_scale"):
        return "vision." + rest.rsplit(".", 1)[-1], None
    if not rest.startswith("encoder.layers."):
        return None
    rest = rest[len("encoder.") :]
    for suffix, part in _CLIP_PARTS.items():
        if rest.endswith("." + suffix):
            return f"vision.{rest[: -len(suffix)]}bounds", part
    if rest.endswith(".linear.weight"):
        return "vision." + rest[: -len("linear.weight")] + "weight", None
    return "vision." + rest, None


_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def export_vision(name: str, param: torch.Tensor) -> list[tuple[str, int | None, torch.Tensor]]:
    """The inverse of `map_vision_name`: one of our "vision." parameters -> [(checkpoint name,
    part, tensor)]."""
    rest = name[len("vision.") :]
    if rest == "projection":
        return [(PROJECTOR_PREFIX + "embedding_projection.weight", None, param)]
    if rest in ("input_proj", "position_embedding_table"):
        return [(f"{PREFIX}patch_embedder.{rest}{'.weight' if rest == 'input_proj' else ''}", None, param)]
    if rest in ("std_bias", "std_scale"):
        return [(PREFIX + rest, None, param)]
    module, leaf = rest.rsplit(".", 1)
    if leaf == "bounds":
        return [(f"{PREFIX}encoder.{module}.{bound}", part, param[part]) for bound, part in _CLIP_PARTS.items()]
    if module.rsplit(".", 1)[-1] in _LINEARS:
        return [(f"{PREFIX}encoder.{module}.linear.weight", None, param)]
    return [(f"{PREFIX}encoder.{rest}", None, param)]
