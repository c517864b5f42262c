"""What each rank keeps of the request in each slot: where its next row starts (its cached length)
and its sampler parameters, on the device.

The engine sends them once, when a request takes the slot (`step.NewRequests`: plain values as the
edge resolved them, which the rank makes the sampler's StepParams rows of); after that the rank
advances them itself from what every plan says anyway: an encoder row (a prompt chunk, a committed
canvas) adds its length to its slot's position, a canvas that starts sets its steps n and canvas
index (`StepPlan.new_canvas_steps`, `new_canvas_index`), and each denoising step run counts n down.
So a steady-state plan names the slots that run and nothing per canvas. The positions are kept on
the host too, where mixed steps build their attention metadata and the static step picks its shape.
"""

from __future__ import annotations

import torch

from blockdiff.diffusion.strategy import DiffusionSampler, StepParams
from blockdiff.model.attention import Row
from blockdiff.step import NewRequests, StepRow


class RequestSlots:
    def __init__(self, sampler: DiffusionSampler, rows: int, device: torch.device):
        """`rows`: the slots and the scratch slot (padded canvases), which keeps position 0 and the
        fields' defaults."""
        self.device = device
        self.sampler = sampler
        self.positions = [0] * rows  # host: the rows' starts
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)  # the same on the device
        self.params = sampler.params_table(rows, device)

    def admit(self, new: NewRequests | None) -> None:
        if new is None:
            return
        slots = torch.tensor(new.slots, dtype=torch.long, device=self.device)
        for slot, position in zip(new.slots, new.positions):
            self.positions[slot] = position
        self.starts.index_copy_(0, slots, torch.tensor(new.positions, dtype=torch.long, device=self.device))
        self.params.put(slots, self.sampler.step_params(new.steps, new.per_canvas, new.seeds, new.canvases))

    def rows(self, plan_rows: list[StepRow]) -> list[Row]:
        """The attention rows of a plan's rows, at their slots' positions (before the step)."""
        return [Row(r.slot, self.positions[r.slot], r.length, r.decoder, bidirectional=r.bidirectional)
                for r in plan_rows]

    def advance(self, plan_rows: list[StepRow]) -> None:
        """The encoder rows' tokens are in the cache now."""
        grown = {}
        for r in plan_rows:
            if not r.decoder:
                self.positions[r.slot] += r.length
                grown[r.slot] = self.positions[r.slot]
        if grown:
            slots = torch.tensor(list(grown), dtype=torch.long, device=self.device)
            self.starts.index_copy_(0, slots, torch.tensor(list(grown.values()), dtype=torch.long, device=self.device))

    def start_canvases(self, slots: torch.Tensor, steps: list[int], index: list[int]) -> None:
        """Canvases start in `slots` (device) at steps n `steps`, canvas indices `index`."""
        self.params.step.index_copy_(0, slots, torch.tensor(steps, dtype=torch.int32, device=self.device))
        self.params.canvas.index_copy_(0, slots, torch.tensor(index, dtype=torch.long, device=self.device))

    def step_params(self, slots: torch.Tensor, options: dict) -> StepParams:
        """The sampler's inputs of the canvases in `slots` (device), with the plan's step options."""
        return self.params.select(slots).with_options(options)

    def stepped(self, slots: torch.Tensor, steps: int) -> None:
        """`steps` denoising steps ran in `slots`: their n counts down (a canvas that finished among
        them is done; its slot's n is set again when its next canvas starts)."""
        self.params.step.index_copy_(0, slots, self.params.step.index_select(0, slots) - steps)  # slots are distinct
