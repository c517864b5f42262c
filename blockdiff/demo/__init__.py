"""The demo model bundled with blockdiff: a small DiffusionGemma trained here on checkable tasks
(`blockdiff train-demo`, docs/demo.md), used when no model is given."""

from __future__ import annotations

import os

CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint")


def demo_checkpoint() -> str:
    """The bundled demo checkpoint's directory."""
    if not os.path.isfile(os.path.join(CHECKPOINT_DIR, "model.safetensors")):
        raise FileNotFoundError(
            f"the demo checkpoint is missing from {CHECKPOINT_DIR}; recreate it with `blockdiff train-demo`"
        )
    return CHECKPOINT_DIR
