"""kdray: Kimi-K2-class MoE inference with DDTree speculative decoding, on Ray."""
import importlib

_EXPORTS = {"LLM": "kdray.llm", "SamplingParams": "kdray.engine.request", "RequestOutput": "kdray.engine.request",
            "CompletionOutput": "kdray.engine.request", "StructuredOutputsParams": "kdray.spec.structured_outputs"}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    """The public names load on first use, so that what needs no engine (the CLI's HTTP commands) imports no torch."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kdray' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
