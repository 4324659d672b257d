"""Tool calls in a chat reply, parsed from its token ids: Kimi-K2's tool-call tokens, or Hermes' JSON.

K2 (when the vocabulary has its tokens)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|> (repeated)
    <|tool_calls_section_end|>

Hermes (every other model): ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, repeated.

The reply's content is its text before the first call. A growing reply parses the same way: K2 calls show their
name as soon as their id is complete and their arguments as they grow; a Hermes call shows once it is closed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

K2_SECTION, K2_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K2_CALL, K2_ARGUMENTS, K2_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
HERMES_CALL, HERMES_CALL_END = "<tool_call>", "</tool_call>"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text (what it is so far, while the call is still being generated)
    id: str | None  # K2: the model's own "functions.NAME:IDX"; Hermes: none, the server makes one
    complete: bool


@dataclass
class ParsedReply:
    content: str  # the text before the first call (all the text, held back where a call may be starting)
    calls: list[ParsedCall]

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.complete]


class ToolCallParser:
    """Parses one tokenizer's replies, in K2's format when its vocabulary has K2's tool-call tokens, else Hermes'."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.k2 = tokenizer.backend.token_to_id(K2_SECTION) is not None
        tokens = (K2_SECTION, K2_SECTION_END, K2_CALL, K2_ARGUMENTS, K2_CALL_END) if self.k2 else \
            (HERMES_CALL, HERMES_CALL_END)
        self.markers = {i: t for t in tokens if (i := tokenizer.backend.token_to_id(t)) is not None}
        self.start = K2_SECTION if self.k2 else HERMES_CALL

    def text(self, ids: list[int]) -> str:
        """``ids`` decoded with the format's tokens written out (decoding skips special tokens)."""
        pieces, run = [], []
        for i in ids:
            if i in self.markers:
                pieces += [self.tokenizer.decode(run), self.markers[i]]
                run = []
            else:
                run.append(i)
        return "".join(pieces) + self.tokenizer.decode(run)

    def parse(self, text: str, final: bool) -> ParsedReply:
        """The content and calls of ``text`` (from :meth:`text`); ``final`` once the reply has ended."""
        at = text.find(self.start)
        if at < 0:
            return ParsedReply(text if final else _hold(text, self.start), [])
        body = text[at:]
        return ParsedReply(text[:at], _k2_calls(body) if self.k2 else _hermes_calls(body, final))


def _hold(text: str, marker: str) -> str:
    """``text`` without an ending that may be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


def _k2_calls(section: str) -> list[ParsedCall]:
    calls = []
    for block in section.split(K2_CALL)[1:]:
        head, named, rest = block.partition(K2_ARGUMENTS)
        if not named:  # the id is still being generated
            break
        arguments, end, _ = rest.partition(K2_CALL_END)
        if not end:  # what no later token changes: not a half character, nor spaces that may be the last
            arguments = arguments.rstrip("\ufffd")
        call_id = head.strip()
        calls.append(ParsedCall(call_id.split(":")[0].split(".")[-1], arguments.strip(), call_id, bool(end)))
        if not end:
            break
    return calls


def _hermes_calls(body: str, final: bool) -> list[ParsedCall]:
    calls = []
    for block in body.split(HERMES_CALL)[1:]:
        payload, end, _ = block.partition(HERMES_CALL_END)
        if not end and not final:
            break
        try:
            call = json.loads(payload)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, TypeError, KeyError):  # not a call: left out
            continue
        if isinstance(name, str) and isinstance(arguments, dict):
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False), None, True))
    return calls
