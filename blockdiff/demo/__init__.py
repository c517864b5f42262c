"""The demo checkpoint used when no model is given.

Until a trained demo model ships, a random tiny checkpoint is created on first use.
"""

from __future__ import annotations

import os


def demo_checkpoint() -> str:
    path = os.path.join(os.path.expanduser(os.environ.get("BLOCKDIFF_CACHE", "~/.cache/blockdiff")), "demo-tiny")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        from blockdiff.model.tiny import make_tiny_model

        make_tiny_model(path)
    return path
