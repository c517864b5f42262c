"""blockdiff: an inference and serving engine for block-diffusion language models."""

from blockdiff.outputs import CompletionOutput, Logprob, RequestOutput
from blockdiff.engine.lora_request import LoRARequest
from blockdiff.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM on first use: a process that imports only light modules of blockdiff (a structured-output
    # build, structured/index.py) does not import torch.
    if name == "LLM":
        from blockdiff.llm import LLM

        return LLM
    raise AttributeError(f"module 'blockdiff' has no attribute {name!r}")
