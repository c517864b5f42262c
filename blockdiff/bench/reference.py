"""transformers' DiffusionGemma generate, driven with the settings of a blockdiff benchmark run.

transformers is an optional dependency of blockdiff (the test oracle); it is imported only here,
only when a comparison is asked for.
"""

from __future__ import annotations

import time

import torch


class TransformersRunner:
    def __init__(self, model_dir: str, dtype: torch.dtype, device: str, max_new_tokens: int, denoising_steps: int):
        try:
            import transformers
            from transformers import DiffusionGemmaForBlockDiffusion
        except ImportError as e:
            raise ValueError(
                "--compare transformers needs transformers with DiffusionGemma (pip install 'transformers==5.23.0'): "
                f"{e}"
            ) from None
        transformers.logging.set_verbosity_error()
        self.device = torch.device(device)
        self.model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.kwargs = dict(
            max_new_tokens=max_new_tokens,
            max_denoising_steps=denoising_steps,
            # never stable, never an EOS: every canvas takes every step, like the blockdiff side
            stability_threshold=denoising_steps,
            eos_token_id=None,
        )
        self.version = transformers.__version__

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seed: int) -> float:
        """Seconds to generate for a batch of equal-length prompts."""
        ids = torch.tensor(prompts, device=self.device)
        torch.manual_seed(seed)
        t = time.perf_counter()
        out = self.model.generate(ids, **self.kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t
        new = out.sequences.shape[1] - ids.shape[1]
        if new < self.kwargs["max_new_tokens"]:
            raise RuntimeError(f"transformers generated {new} tokens, {self.kwargs['max_new_tokens']} were asked")
        return seconds
