"""kdray: Kimi-K2-class MoE inference with DDTree speculative decoding, on Ray."""
from kdray.engine.request import CompletionOutput, RequestOutput, SamplingParams
from kdray.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
