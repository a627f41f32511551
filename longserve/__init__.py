"""LongServe: a compact LLM inference engine for long contexts on several GPUs. The names below
load on first use, so a process that only starts workers (engine/__main__.py) imports no torch."""
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from longserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from longserve.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from longserve.engine import request
        return getattr(request, name)
    raise AttributeError(f"module 'longserve' has no attribute {name!r}")
