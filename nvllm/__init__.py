"""nvllm: fast, checked LLM inference — quantize, serve, bench and eval on one engine."""

from nvllm.beam_search import BeamSearchParams
from nvllm.config import EngineConfig
from nvllm.llm import LLM
from nvllm.lora.request import LoRARequest
from nvllm.outputs import CompletionOutput, RequestOutput
from nvllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "EngineConfig",
           "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
