"""blockdiff: an inference and serving engine for block-diffusion language models."""

from blockdiff.llm import LLM
from blockdiff.outputs import CompletionOutput, Logprob, RequestOutput
from blockdiff.sampling_params import LoRARequest, SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
