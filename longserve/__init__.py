"""LongServe: a compact LLM inference engine for long contexts on several GPUs."""
from longserve.engine.request import CompletionOutput, RequestOutput
from longserve.llm import LLM
from longserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
