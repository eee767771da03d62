"""kvforge: an LLM inference and serving engine with a paged KV cache and continuous batching."""

from kvforge.llm import LLM
from kvforge.outputs import CompletionOutput, Logprob, RequestOutput
from kvforge.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
