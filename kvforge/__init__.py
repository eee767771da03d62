"""kvforge: an LLM inference and serving engine with a paged KV cache and continuous batching."""

from kvforge.llm import LLM
from kvforge.lora.request import LoRARequest
from kvforge.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from kvforge.pooling_params import PoolingParams
from kvforge.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "Logprob", "PoolingOutput", "PoolingParams",
           "PoolingRequestOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
