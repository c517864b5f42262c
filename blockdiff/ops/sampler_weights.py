"""The sampler's weights exp(y) of shifted logits y <= 0, with the ones below float32's normal range
taken as 0.

exp(y) for y below -87.3 is smaller than float32's smallest normal number (2^-126): a denormal,
or 0 below -103.9. CPUs compute such results through microcode assists, about ten times slower
than the rest: 11 ms of a bfloat16 step's ~150 ms at batch 1 on the 319M benchmark config, whose
shifted logits reach -150 at the last denoising step's temperature of 0.4 (a softcap of 30 spans
60, divided by 0.4; docs/benchmarks.md). No such weight can move what the sampler derives from a
row: its most likely token weighs exp(0) = 1, so the row's total is at least 1, and anything below
2^-126 added to it rounds away; a draw (inverse CDF, uniforms on a grid of 2^-24) reaches such a
token only when its uniform is exactly 0, and then takes the first token with any weight, which is
now the first of weight e^-87 or more; and in the self-conditioning product each adds at most
2^-126 times an embedding entry to sums rounded to the model's dtype. What changes is an entropy as
small as about 1e-33 (a row whose every other token lies below the floor), which becomes 0. So below EXP_FLOOR a weight is 0, in
every kernel: the reference's here and the Triton ones (ops/triton_sampler.py), which take the
constant from here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# exp(-87) = 1.6e-38 is still normal: every weight kept is exp(y) to the last bit.
EXP_FLOOR = -87.0
# The float32 just below the floor, which every y under it is clamped to, and a cut halfway between
# its exp and the floor's (~44 units in the last place from each): a weight at or below the cut is
# one that was clamped. No mask is kept, and no temporary of the weights' size is made.
_BELOW_FLOOR = float(torch.tensor(EXP_FLOOR).nextafter(torch.tensor(-math.inf)))
_CUT = math.exp((EXP_FLOOR + _BELOW_FLOOR) / 2)


def weights_exp(y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """exp(y) of float32 y, 0 where y < EXP_FLOOR; into `out` where given (`out` may be y itself)."""
    # One compare-and-select after exp, and no temporary of y's size: a kept-mask multiplied in took 5
    # bytes per weight beside the sampler's tile (the bool mask and its float32 cast), and 2-3x the time.
    return F.threshold_(torch.clamp(y, min=_BELOW_FLOOR, out=out).exp_(), _CUT, 0.0)
