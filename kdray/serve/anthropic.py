"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the chat handler.

A Messages request is validated strictly in Anthropic's field names, then becomes a chat completion request: the
system prompt a system message, ``tool_use`` blocks the assistant's tool calls, ``tool_result`` blocks tool messages,
``thinking`` blocks the assistant's reasoning, a final assistant message the start of the reply (prefill). The reply
is rendered as a Message (``thinking``, ``text`` and ``tool_use`` content blocks, the stop reason, usage) or as
Anthropic's stream of events. Errors take Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

What kdray does with Anthropic-only fields: ``cache_control`` marks are met by the automatic prefix cache, which keeps
every prompt's prefix while its pages are not needed (a ``ttl`` is refused: nothing is kept for a fixed time);
``thinking`` ``disabled`` closes a thinking model's thought in the prompt, so it answers at once, ``enabled`` cuts
the thought after ``budget_tokens`` (:class:`~kdray.serve.thought_budget.BudgetedThought`), ``adaptive`` lets it run
as the model does, ``display: omitted`` leaves it out of the reply (``summarized`` shows it whole); a thought is not
signed (``signature`` is empty, and one sent back is not checked); a ``tool_result`` with ``is_error`` reaches the
template as ``Error: <content>``.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from kdray.engine.request import MAX_TOKENS, MAX_TOP_K, join_output
from kdray.serve.async_engine import RequestStream
from kdray.serve.protocol import (MAX_STOP, MAX_STOP_CHARS, APIError, ChatCompletionRequest, FieldError, Strict,
                                  validate)
from kdray.serve.serving import OpenAIResponse, OpenAIServing, Sent, api_error, collect

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # OpenAI's finish reason -> Anthropic's
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}  # what each role sends
BLOCK_TYPES = tuple(dict.fromkeys(kind for kinds in BLOCKS.values() for kind in kinds))  # every block kdray reads
TOOL_ERROR = "Error: "  # how a tool_result with is_error reaches the chat template


def error_body(err: APIError) -> dict:
    """``err`` in Anthropic's shape (the same status)."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _refusing(key: str, why: str):
    """A model's check that refuses ``key``, an Anthropic field kdray does not serve, saying ``why``."""
    def check(cls, data: Any) -> Any:
        if isinstance(data, dict) and key in data:
            raise FieldError((key,), f"{why}; leave {key} out")
        return data

    return model_validator(mode="before")(classmethod(check))


class CacheControl(Strict):
    """A prompt-caching mark: met by the automatic prefix cache."""

    type: Literal["ephemeral"]

    _no_ttl = _refusing("ttl", "kdray's prefix cache keeps a prefix while its pages are not needed, not for a fixed "
                               "time")


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


def _text_blocks(v: Any) -> Any:
    """Content given as a string is one text block."""
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] = []
    is_error: bool = False
    cache_control: CacheControl | None = None

    _content = field_validator("content", mode="before")(_text_blocks)

    @property
    def text(self) -> str:
        text = "".join(b.text for b in self.content)
        return TOOL_ERROR + text if self.is_error else text


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # not checked: kdray does not sign thoughts


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: list[Block]

    _content = field_validator("content", mode="before")(_text_blocks)

    @model_validator(mode="before")
    @classmethod
    def _blocks_of_the_role(cls, data: Any) -> Any:
        """A block type kdray does not read, or one the role does not send, is refused naming its index."""
        if not isinstance(data, dict) or data.get("role") not in BLOCKS or not isinstance(data.get("content"), list):
            return data
        allowed = BLOCKS[data["role"]]
        for i, block in enumerate(data["content"]):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in allowed:
                why = (f"{data['role']} messages send {', '.join(allowed)} blocks" if kind in BLOCK_TYPES else
                       f"kdray's models read {', '.join(BLOCK_TYPES)} blocks only")
                raise FieldError(("content", i, "type"), f"'{kind}' blocks are not accepted here: {why}")
        return data

    def blocks(self, kind: type) -> list:
        return [b for b in self.content if isinstance(b, kind)]

    def text(self) -> str:
        return "".join(b.text for b in self.blocks(TextBlock))


class ToolDefinition(Strict):
    """A tool the client runs (Anthropic's server tools, which run on its servers, are refused)."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] = "custom"
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type", "custom") != "custom":
            raise FieldError(("type",), f"'{data['type']}' is a server tool, run by Anthropic's servers; kdray serves "
                                        "tools the client runs: {name, description, input_schema}")
        return data


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1)
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "none" and self.disable_parallel_tool_use:
            raise FieldError(("disable_parallel_tool_use",), "applies where calls may be made; leave it out with "
                                                             "'none'")
        return _needed_with(self, "name", "tool")


class ThinkingConfig(Strict):
    """``enabled``: a thought of at most ``budget_tokens``; ``adaptive``: as long as the model thinks; ``disabled``:
    none. ``display``: ``summarized`` shows the thought (whole: kdray does not summarize), ``omitted`` leaves it
    out of the reply."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)  # the thought's most tokens (Anthropic: >= 1024)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "disabled" and self.display is not None:
            raise FieldError(("display",), "applies to a thought; leave it out with 'disabled'")
        return _needed_with(self, "budget_tokens", "enabled")


class JSONOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    """Structured outputs: the reply's text follows ``format``'s JSON schema (constrained decoding)."""

    format: JSONOutputFormat | None = None

    _no_effort = _refusing("effort", "kdray does not scale a model's effort (a thinking model's thought can be capped "
                                     "with thinking.budget_tokens)")


def _needed_with(model: Strict, field: str, kind: str) -> Strict:
    """``model`` if its ``field`` is given exactly when its ``type`` is ``kind``."""
    if (getattr(model, field) is None) == (model.type == kind):
        raise FieldError((field,), f"is needed when type is '{kind}', and only then")
    return model


class Metadata(Strict):
    user_id: str | None = None  # for the client's own bookkeeping, as OpenAI's ``user``: accepted, no effect


class MessagesPrompt(Strict):
    """What the prompt is made of: ``POST /v1/messages/count_tokens`` counts it."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # the reply's format: no effect on the prompt's tokens
    cache_control: CacheControl | None = None  # on the whole prompt: met by the prefix cache, as a block's

    _system = field_validator("system", mode="before")(_text_blocks)

    @model_validator(mode="after")
    def _conversation(self) -> MessagesPrompt:
        names = [t.name for t in self.tools or []]
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not names:
            raise FieldError(("tool_choice",), f"'{choice.type}' needs tools; send tools or leave it out")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise FieldError(("tool_choice",), f"names tool '{choice.name}', which tools do not declare (they "
                                               f"declare {names})")
        if self.output_config and self.output_config.format and choice is not None and choice.type in ("any", "tool"):
            raise FieldError(("output_config", "format"), f"does not apply to a reply that tool_choice '{choice.type}'"
                                                          " makes tool calls; leave one of them out")
        last = self.messages[-1]
        if last.role == "assistant" and (last.blocks(ToolUseBlock) or last.blocks(ThinkingBlock)):
            raise FieldError(("messages", len(self.messages) - 1), "a final assistant message is the start of the "
                             "reply, which continues its text: send it with text blocks only")
        return self

    def chat_fields(self) -> dict:
        """The chat completion request's fields for this prompt."""
        messages = [] if self.system is None else [{"role": "system", "content": "".join(b.text for b in self.system)}]
        for m in self.messages:
            if m.role == "user":
                messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
                             for b in m.blocks(ToolResultBlock)]
                if m.blocks(TextBlock) or not m.blocks(ToolResultBlock):
                    messages.append({"role": "user", "content": m.text()})
                continue
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.blocks(ToolUseBlock)]
            message = {"role": "assistant", "content": m.text() if m.text() or not calls else None,
                       "tool_calls": calls or None}
            if m.blocks(ThinkingBlock):
                message["reasoning_content"] = "".join(b.thinking for b in m.blocks(ThinkingBlock))
            messages.append(message)
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.messages[-1].role == "assistant":
            fields |= {"add_generation_prompt": False, "continue_final_message": True}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                 "parameters": t.input_schema}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}})
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_, "strict": True}}
        return fields


class MessagesRequest(MessagesPrompt):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        [], max_length=MAX_STOP)
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise FieldError(("thinking", "budget_tokens"), f"must be less than max_tokens ({self.max_tokens}), which "
                                                            "counts the thought")
        return self

    def chat_request(self, thinks: bool, thought_budget: int | None) -> ChatCompletionRequest:
        """The chat completion request of this one, for a model that ``thinks`` or not (``thought_budget``: its
        ``thinking_token_budget``)."""
        omitted = thinks and self.thinking is not None and self.thinking.display == "omitted"
        return validate(ChatCompletionRequest, {
            **self.chat_fields(), "max_tokens": self.max_tokens, "stop": self.stop_sequences, "stream": self.stream,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "thinking_token_budget": thought_budget, "include_reasoning": not omitted})


class AnthropicServing:
    """The Messages API on an :class:`OpenAIServing`: requests translated to chat requests, replies rendered back."""

    def __init__(self, openai: OpenAIServing):
        self.openai = openai

    async def messages(self, data: dict) -> dict | AsyncIterator[str]:
        """``POST /v1/messages``: a Message, or its events when ``stream`` is true."""
        arrived = time.perf_counter()
        req = validate(MessagesRequest, data, BLOCK_TYPES)
        chat = req.chat_request(self.openai.reasoning is not None, self._budget(req))
        response, stream, ids = await self.openai.submit_chat(chat)
        reply = _Reply(response, f"msg_{response.rid.split('-', 1)[1]}")
        if req.stream:
            return reply.events(stream, self.openai.first_token(arrived))
        return reply.message(response.body(await collect(stream, ids)))

    async def count_tokens(self, data: dict) -> dict:
        """``POST /v1/messages/count_tokens``: the prompt's tokens, as /v1/messages would send them."""
        req = validate(MessagesPrompt, data, BLOCK_TYPES)
        self.openai.check_model(req.model)
        chat = validate(ChatCompletionRequest, req.chat_fields())
        return {"input_tokens": len(await self.openai.prompt(chat, close_thought=self._budget(req) == 0))}

    def _budget(self, req: MessagesPrompt) -> int | None:
        """The thinking model's thought budget the request's ``thinking`` sets: ``budget_tokens`` (``enabled``), 0
        (``disabled``: closed in the prompt), or none (``adaptive``: the model's own)."""
        thinking = req.thinking
        if thinking is None or self.openai.reasoning is None and thinking.type != "enabled":
            return None  # adaptive and disabled: what a model that does not think does
        if self.openai.reasoning is None:
            raise APIError(400, f"thinking: model '{self.openai.model_name}' does not think (its chat template writes "
                           "no <think>); leave thinking out", param="thinking")
        return {"enabled": thinking.budget_tokens, "adaptive": None, "disabled": 0}[thinking.type]


class _Reply:
    """One Message's shapes, made from the chat handler's (``response``; one choice)."""

    def __init__(self, response: OpenAIResponse, message_id: str):
        self.response, self.id = response, message_id

    def _head(self, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.response.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage}

    def message(self, body: dict) -> dict:
        """The Message of a whole chat completion ``body``."""
        choice = body["choices"][0]
        message, content = choice["message"], []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message["content"]:
            content.append({"type": "text", "text": message["content"]})
        stop = _stop(choice["finish_reason"], choice["stop_reason"])
        for call in message.get("tool_calls", []):
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            try:
                content.append({"type": "tool_use", "id": call["id"], "name": name,
                                "input": _json_object(arguments)})
            except ValueError:  # a call the model wrote without an object of arguments: its text, not a tool use
                content.append({"type": "text", "text": f"{name} {arguments}"})
        if stop["stop_reason"] == "tool_use" and not any(b["type"] == "tool_use" for b in content):
            stop["stop_reason"] = "end_turn"
        usage = body["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {**self._head(_usage(usage["prompt_tokens"], cached, usage["completion_tokens"])), "content": content,
                **stop}

    async def events(self, stream: RequestStream, first_token: Callable[[], None]) -> AsyncIterator[str]:
        """Anthropic's events for a streamed reply: ``message_start``, per content block its start, deltas and stop,
        then ``message_delta`` (stop reason, usage) and ``message_stop``; an error after the status line is an
        ``error`` event."""
        response, sent, whole = self.response, Sent(), {}
        blocks: list[str] = []  # each block's type, in order; the last one is open until the next starts
        started = False

        def start(kind: str, block: dict) -> list[str]:
            events = [_event("content_block_stop", index=len(blocks) - 1)] if blocks else []
            blocks.append(kind)
            return events + [_event("content_block_start", index=len(blocks) - 1, content_block=block)]

        try:
            async for added in stream:
                out = join_output(whole, added)
                if not started:  # once the prompt is in: its tokens the prefix cache held are known
                    started = True
                    yield _event("message_start", message=self._head(_usage(len(out.prompt_token_ids),
                                                                            out.num_cached_tokens, 0)))
                c = response.sample(out)
                thought, text, calls, finish = response.delta(c, out.finished, sent)
                if thought:
                    if not blocks or blocks[-1] != "thinking":
                        for e in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield e
                    yield _event("content_block_delta", index=len(blocks) - 1,
                                 delta={"type": "thinking_delta", "thinking": thought})
                if text:
                    if not blocks or blocks[-1] != "text":
                        for e in start("text", {"type": "text", "text": ""}):
                            yield e
                    yield _event("content_block_delta", index=len(blocks) - 1,
                                 delta={"type": "text_delta", "text": text})
                for call in calls:  # a call's arguments grow only until the next call starts
                    if "id" in call:
                        for e in start("tool_use", {"type": "tool_use", "id": call["id"],
                                                    "name": call["function"]["name"], "input": {}}):
                            yield e
                    if call["function"]["arguments"]:
                        yield _event("content_block_delta", index=len(blocks) - 1,
                                     delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
                if len(c.token_ids) > sent.ids and first_token is not None:
                    first_token()
                    first_token = None
                sent.ids = len(c.token_ids)
                if finish:
                    if blocks:
                        yield _event("content_block_stop", index=len(blocks) - 1)
                    usage = _usage(len(out.prompt_token_ids), out.num_cached_tokens, sent.ids)
                    yield _event("message_delta", delta=_stop(finish, c.stop_reason), usage=usage)
                    yield _event("message_stop")
        except Exception as e:  # noqa: BLE001 - the status line is gone: report the error in the stream
            yield _event("error", error=error_body(api_error(e, "a stream"))["error"])
        finally:
            stream.abort()


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Anthropic's usage: input tokens beyond those the prefix cache held, and those it held (read)."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(finish: str, stop_reason: int | str | None) -> dict:
    """Anthropic's stop reason (and the stop sequence that ended the reply) of a chat finish reason."""
    if finish == "stop" and isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _event(kind: str, **fields) -> str:
    """One server-sent event of Anthropic's stream: its type as the event name and in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"
