"""kdray: Kimi-K2-class MoE inference with DDTree speculative decoding, on Ray."""
from kdray.engine.request import CompletionOutput, RequestOutput, SamplingParams
from kdray.llm import LLM
from kdray.spec.grammar import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
