"""A thinking model's reasoning, apart from its reply (``reasoning_content``, as Moonshot's and DeepSeek's APIs name
it): a chat reply that opens with ``<think>`` (or whose prompt ends inside one) reasons until ``</think>``, or until
Kimi-K2's tool-call section begins (K2-Thinking may call tools without closing its thought); the content is what
follows.

A model thinks, for kdray, when its vocabulary has both tokens and its chat template writes ``<think>``
(Kimi-K2-Thinking's does; K2-Instruct's does not). The split is made on token ids, so it holds however decoding
treats the markers, and :class:`ReasoningSplit` finds it as a stream grows, reading each id once. A grammar
(``response_format``, a forced tool call) holds the content only: :meth:`ReasoningFormat.grammar` lets the
reasoning run free before it.
"""
from __future__ import annotations

from kdray.model.tokenizer import Tokenizer
from kdray.serve.tool_calls import K2_SECTION
from kdray.spec.grammar import after_reasoning
from kdray.spec.structured_outputs import StructuredOutputsParams

THINK, THINK_END = "<think>", "</think>"


class ReasoningFormat:
    """One thinking model's markers: ``<think>``, ``</think>`` and K2's tool-call section (an implicit end); its
    tokenizer decodes the reasoning."""

    def __init__(self, tokenizer: Tokenizer, think: int, think_end: int, section: int | None):
        self.tokenizer, self.think, self.think_end, self.section = tokenizer, think, think_end, section

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> ReasoningFormat | None:
        """The format of a model that thinks; None for one that does not."""
        if tokenizer is None or not any(THINK in t for t in _templates(tokenizer)):
            return None
        ids = [tokenizer.backend.token_to_id(t) for t in (THINK, THINK_END, K2_SECTION)]
        return None if None in ids[:2] else cls(tokenizer, *ids)

    def opened(self, prompt: list[int]) -> bool:
        """The prompt ends inside a thought: its last marker is ``<think>`` (a template that starts the thought)."""
        for token in reversed(prompt):
            if token in (self.think, self.think_end):
                return token == self.think
        return False

    def grammar(self, params: StructuredOutputsParams, opened: bool) -> StructuredOutputsParams:
        """``params``' grammar after a thought: a whole ``<think>...</think>`` or none (``opened``: the rest of the
        thought, then ``</think>``), free of every token but the markers (K2's tool-call section waits for the
        grammar too, which may call tools after the thought)."""
        held = () if self.section is None else (self.section,)
        return after_reasoning(params, self.think, self.think_end, opened, held)


class ReasoningSplit:
    """Where one reply's reasoning lies in its token ids, found as they grow: ``[start, end)`` (``start`` None when the
    reply does not think, ``end`` None while the reasoning runs) and ``content``, the content's first id (None while
    the reasoning runs)."""

    def __init__(self, fmt: ReasoningFormat, opened: bool):
        self.fmt, self.seen = fmt, 0
        self.start, self.end, self.content = (0, None, None) if opened else (None, None, 0)
        self.decided = opened  # whether the first id has been read (it may open a thought)
        self.boundary: int | None = None  # the reasoning's characters, once it has ended
        self.reasoning: str | None = None  # its text, once it has ended

    @property
    def thinks(self) -> bool:
        return self.start is not None

    def feed(self, ids: list[int]):
        """Read the ids after those fed before (``ids``: the whole reply so far)."""
        fmt = self.fmt
        if not self.decided and ids:
            self.decided = True
            if ids[0] == fmt.think:
                self.start, self.content, self.seen = 1, None, 1
        if self.thinks and self.end is None:
            for i in range(max(self.seen, self.start), len(ids)):
                if ids[i] == fmt.think_end:
                    self.end, self.content = i, i + 1
                    break
                if ids[i] == fmt.section:  # the call section is content: the tool-call parser reads it
                    self.end = self.content = i
                    break
        self.seen = len(ids)

    def texts(self, text: str, ids: list[int]) -> tuple[str | None, str]:
        """The reasoning's text (None: the reply does not think) and the content's, from the reply's ``text`` (the
        engine's: stop strings cut, a running reply's unsettled tail held back) and its ``ids``."""
        if not self.thinks:
            return None, text
        if self.end is None:
            return text, ""
        if self.boundary is None:  # decoding skips the markers, so the text up to the end is the reasoning's
            self.boundary = len(self.fmt.tokenizer.decode(ids[:self.end]))
        if self.reasoning is None or len(self.reasoning) != min(len(text), self.boundary):  # made once it is whole
            self.reasoning = text[:self.boundary]  # (the text may lag the ids, or a stop string cut into it)
        return self.reasoning, text[self.boundary:]

    @property
    def tokens(self) -> int:
        """How many of the ids fed are reasoning (the markers left out)."""
        if not self.thinks:
            return 0
        return (self.seen if self.end is None else self.end) - self.start


def _templates(tokenizer: Tokenizer) -> list[str]:
    template = tokenizer.chat_template
    return [] if not template else [template] if isinstance(template, str) else list(template.values())
