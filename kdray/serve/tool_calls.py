"""Tool calls in a chat reply, parsed from its token ids: Kimi-K2's tool-call tokens, or Hermes' JSON.

K2 (when the vocabulary has its tokens)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|> (repeated)
    <|tool_calls_section_end|>

Hermes (every other model): ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, repeated.

The reply's content is its text before the first call. A growing reply parses the same way: K2 calls show their
name as soon as their id is complete and their arguments as they grow; a Hermes call shows once it is closed.
:meth:`ToolCallParser.grammar` is the other direction: the grammar of a reply that is nothing but calls in the
format, which constrained decoding holds a forced reply to (``tool_choice`` "required" or a named function).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kdray.model.tokenizer import IncrementalDetokenizer

K2_SECTION, K2_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K2_CALL, K2_ARGUMENTS, K2_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
HERMES_CALL, HERMES_CALL_END = "<tool_call>", "</tool_call>"
K2_INDEX = "[0-9]{1,4}"  # the call's number in a K2 id (functions.NAME:IDX)
ARGUMENTS_WHITESPACE = 1  # whitespace characters a forced call's JSON may hold in a row


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

    def grammar(self, functions: list[tuple[str, dict | None]], several: bool) -> str:
        """The xgrammar structural tag (JSON text) of a reply made of one call (``several``: one or more) to any of
        ``functions`` ((name, parameters schema or None: no parameters)), in this parser's format, arguments
        following the schema."""
        calls = [self._call_grammar(name, params) for name, params in functions]
        call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        if self.k2:
            calls = {"type": "plus", "content": call} if several else call
            reply = _sequence(self._marker(K2_SECTION), calls, self._marker(K2_SECTION_END))
        else:  # Hermes: calls one per line
            reply = _sequence(call, {"type": "star", "content": _sequence(_text("\n"), call)}) if several else call
        return json.dumps({"type": "structural_tag", "format": reply})

    def _call_grammar(self, name: str, parameters: dict | None) -> dict:
        arguments = {"type": "json_schema", "json_schema": parameters or {"type": "object", "properties": {}},
                     "max_whitespace_cnt": ARGUMENTS_WHITESPACE}
        if self.k2:
            return _sequence(self._marker(K2_CALL), _text(f"functions.{name}:"), {"type": "regex", "pattern": K2_INDEX},
                             self._marker(K2_ARGUMENTS), arguments, self._marker(K2_CALL_END))
        call = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments["json_schema"]},
                "required": ["name", "arguments"], "additionalProperties": False}
        return _sequence(self._marker(HERMES_CALL), _text("\n"), {**arguments, "json_schema": call}, _text("\n"),
                         self._marker(HERMES_CALL_END))

    def _marker(self, text: str) -> dict:
        """The format's marker: its token where the vocabulary has one, else its text."""
        ids = [i for i, t in self.markers.items() if t == text]
        return {"type": "token", "token": ids[0]} if ids else _text(text)

    def parse(self, text: str, final: bool, at: int | None = None) -> ParsedReply:
        """The content and calls of ``text`` (a :class:`ToolText`'s); ``final`` once the reply has ended; ``at``: where
        the first call starts in it (-1: nowhere), when the caller knows (:meth:`ToolText.first_call`)."""
        at = text.find(self.start) if at is None else at
        if at < 0:
            return ParsedReply(text if final else _hold(text, self.start), [])
        body = text[at:]
        return ParsedReply(text[:at], _k2_calls(body) if self.k2 else _hermes_calls(body, final))


class ToolText:
    """A reply's text as :meth:`ToolCallParser.parse` reads it: decoded, with the format's tokens written out from the
    first call's start on (before it they decode as decoding does: a special token as nothing). It grows with the
    reply (a stream's), decoding only the ids added since the last call, and where its first call starts is looked
    for only in the text added since (decoding the whole reply, or searching all of it, at every step made a reply of
    n tokens cost O(n^2)). While the reply runs its text holds back a character still unfinished."""

    def __init__(self, parser: ToolCallParser, start: int = 0):
        self.parser, self.seen, self.settled = parser, start, ""  # start: the reply's first id (after a reasoning)
        self._run = IncrementalDetokenizer(parser.tokenizer)  # the ids since the last marker
        self._at, self._searched = -1, 0  # where the first call starts (-1: not yet), in the first _searched chars
        self._started = False  # the first call's start marker has been written

    def text(self, ids: list[int], final: bool) -> str:
        """The text of the reply in ``ids`` (all ids so far: those seen before, then new ones); ``final`` once it
        ended."""
        markers, new = self.parser.markers, []
        for i in ids[self.seen:]:
            self._started = self._started or markers.get(i) == self.parser.start
            if self._started and i in markers:
                new += [self._run.flush(), markers[i]]
                self._run = IncrementalDetokenizer(self.parser.tokenizer)
            else:
                new.append(self._run.add([i]))
        self.seen = len(ids)
        if final:
            new.append(self._run.flush())
        self.settled += "".join(new)
        return self.settled

    def first_call(self) -> int:
        """Where the first call starts in :meth:`text` so far (-1: nowhere yet)."""
        if self._at < 0:
            self._at = self.settled.find(self.parser.start, max(0, self._searched - len(self.parser.start) + 1))
            self._searched = len(self.settled)
        return self._at


def _text(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _sequence(*elements: dict) -> dict:
    return {"type": "sequence", "elements": list(elements)}


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
