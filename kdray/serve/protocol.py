"""OpenAI request models, error bodies and server-sent events.

Requests are validated strictly (a string where a number belongs is an error, not a conversion, every number
is bounded, and a field kdray does not implement is refused, except the few in METADATA_FIELDS) and every
failure becomes an :class:`APIError` whose message and ``param`` name the offending field.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from kdray.engine.request import (MAX_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY,
                                  MAX_SEED, MAX_TOKENS, MAX_TOP_K, MAX_VOCAB, SamplingParams)
from kdray.spec.structured_outputs import StructuredOutputsParams

MAX_N = 16  # choices per request
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request
METADATA_FIELDS = ("user", "safety_identifier", "metadata")  # for the client's own bookkeeping: accepted, no effect
# Refused fields with more to say than "not implemented"
_UNSUPPORTED = {
    "suffix": "text after the completion (fill-in-the-middle) is not supported by kdray's chat-style models",
    "functions": "the deprecated functions API is not supported; send tools",
    "function_call": "the deprecated function_call is not supported; send tool_choice",
}
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body
SSE_DONE = "data: [DONE]\n\n"
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


class APIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None):  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 that says why it is not one (malformed, NaN or Infinity,
    an integer of more than 4300 digits, nested deeper than ``MAX_JSON_DEPTH``, text that is not Unicode)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise APIError(400, f"malformed JSON in the request body: {what}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    _check_tree(data)
    return data


class FieldError(ValueError):
    """A check across fields that names the one it is about (its path inside the model being validated)."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


def _check_tree(data: dict):
    """Refuse nesting deeper than ``MAX_JSON_DEPTH`` and strings holding lone UTF-16 surrogates (``"\\ud800"``
    is valid JSON but no text), naming where they are."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                name = where.encode(errors="backslashreplace").decode()  # the path may hold the surrogate
                raise APIError(400, f"{name}: holds a lone UTF-16 surrogate, which is not text; send valid Unicode",
                               param=name, code="invalid_value") from None
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                top = where.split(".")[0].split("[")[0]
                raise APIError(400, f"{top}: nests arrays or objects deeper than {MAX_JSON_DEPTH} levels",
                               param=top, code="invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) or isinstance(item, (str, dict, list)):  # numbers need no look
                    inner = f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else key)
                    stack += [(key, inner, depth), (item, inner, depth + 1)]


def _field(loc: tuple) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate(model: type[BaseModel], data: dict, tags: tuple[str, ...] = ()):
    """``model`` built from ``data``; the first validation error becomes a 400 naming its field (``tags``: the tags of
    a discriminated union of list items, which pydantic's path names after the item's index, left out of the name)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, FieldError):  # a model's check: name (and show, when given) the field it is about
            value = _at(err["input"], cause.loc)
            err = {"type": err["type"], "msg": err["msg"], "loc": (*err["loc"], *cause.loc),
                   **({} if value is None else {"input": value})}
        loc = err["loc"]
        name = _field([p for i, p in enumerate(loc) if not (p in tags and i and isinstance(loc[i - 1], int))])
        if err["type"] == "extra_forbidden":
            why = _UNSUPPORTED.get(name, "kdray does not implement this field")
            raise APIError(400, f"{name}: {why}; leave it out", param=name, code="unsupported_field") from None
        msg = err["msg"].removeprefix("Value error, ")
        got = f" (got {_brief(err['input'])})" if "input" in err and err["type"] != "missing" else ""
        raise APIError(400, f"{name}: {msg}{got}", param=name, code="invalid_value") from None


def _at(value: Any, loc: tuple) -> Any:
    """What lies at ``loc`` inside ``value`` (None where nothing does)."""
    for part in loc:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _brief(value: Any) -> str:
    """A short rendering of a bad value for an error message (a container is described, not printed)."""
    if isinstance(value, (dict, list)):
        return f"{'an object' if isinstance(value, dict) else 'an array'} of {len(value)} items"
    if isinstance(value, int) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    return json.dumps(value)[:80]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        """An explicit ``null`` means "the default", as OpenAI clients use it."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(Strict):
    include_usage: bool = False


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


class JSONSchemaSpec(Strict):
    """``response_format.json_schema``: the schema the reply follows (``strict``: no properties beyond the ones it
    names, even where the schema leaves them open)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool = False


class ResponseFormat(Strict):
    """``response_format``: plain text, any JSON object, or JSON following a schema (constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.json_schema is None) == (self.type == "json_schema"):
            raise FieldError(("json_schema",), "missing: type 'json_schema' needs it" if self.json_schema is None
                             else f"only goes with type 'json_schema', not '{self.type}'")
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The engine's grammar of this format (None for text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=self.json_schema.schema_,
                                       disable_additional_properties=self.json_schema.strict)


class GenerationRequest(Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # -1 (vLLM's "off") and 0 both disable it
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] = Field([], max_length=MAX_STOP)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # kdray / vLLM extension: token ids beside the text
    presence_penalty: float = Field(SamplingParams.presence_penalty, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(SamplingParams.frequency_penalty, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(SamplingParams.repetition_penalty, gt=0, le=MAX_REPETITION_PENALTY)  # vLLM's
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] = Field({}, max_length=MAX_LOGIT_BIAS)
    min_p: float = Field(SamplingParams.min_p, ge=0, le=1)  # vLLM's
    min_tokens: int = Field(SamplingParams.min_tokens, ge=0, le=MAX_TOKENS)  # vLLM's
    response_format: ResponseFormat | None = None
    user: str | None = None  # METADATA_FIELDS
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v):
            raise ValueError(f"must be a string or a list of strings, each of 1 to {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _seeds_fit(self) -> GenerationRequest:
        """Choice ``j`` samples with ``seed + j``: every one must fit the engine's 63 bits."""
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise APIError(400, f"seed: with n={self.n}, seed + n - 1 must be at most 2^63 - 1 = {MAX_SEED}",
                           param="seed", code="invalid_value")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k in v if not (k.isascii() and k.isdigit() and len(k) <= 9 and int(k) < MAX_VOCAB)]
        if bad:
            raise ValueError(f"keys must be token ids written as decimal strings, like \"50256\" (got {bad[0][:20]!r})")
        return v

    @property
    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer keys, None when empty."""
        return {int(k): b for k, b in self.logit_bias.items()} or None

    @model_validator(mode="after")
    def _stream_options(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise FieldError(("stream_options",), "only applies with stream: true; leave it out")
        return self

    @model_validator(mode="after")
    def _grammar_ends_the_reply(self) -> GenerationRequest:
        if self.min_tokens and self.constrained:
            raise FieldError(("min_tokens",), "cannot be combined with a grammar (response_format, or tool_choice "
                                              "forcing a call): the grammar decides where the reply ends")
        return self

    @property
    def constrained(self) -> bool:
        """The reply follows a grammar."""
        return self.response_format is not None and self.response_format.type != "text"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def reported_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine reports (None: the prompt is not scored)."""
        return None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: list[str | list[int]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)  # 0 (with echo): the prompt alone (vLLM's)
    echo: bool = False  # the prompt's text before each choice's (with logprobs, its tokens' log-probabilities too)
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the top alternatives reported beside each token

    @property
    def reported_logprobs(self) -> int | None:
        """Alternatives per token the engine reports (None: no log-probabilities)."""
        return self.logprobs

    @property
    def reported_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine reports: echo with logprobs scores the prompt."""
        return self.logprobs if self.echo else None

    @model_validator(mode="after")
    def _prompt_alone(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError(("max_tokens",), "0 answers the prompt alone, which needs echo: true; ask for at least "
                                              "1 token or send echo")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) or _is_token_ids(v) else v
        if not isinstance(v, list) or not v or not all((isinstance(p, str) and p) or _is_token_ids(p) for p in v):
            raise ValueError("must be a non-empty string, a non-empty list of token ids (integers >= 0), "
                             "or a non-empty list of either")
        return v

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError(("best_of",), f"must equal n ({self.n}): kdray returns every sample it draws, it does "
                                           "not rank them; leave it out")
        return self


class FunctionCall(Strict):
    name: str = Field(min_length=1)
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            ok = isinstance(json.loads(v), dict)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("must be a JSON object, written as a string")
        return v


class ToolCall(Strict):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    """One message: text content (parts joined), and for the assistant the tool calls it made, for a tool the
    id of the call it answers."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # an assistant's reasoning, for a thinking model's template ("reasoning": vLLM's newer name and OpenRouter's)
    reasoning_content: str | None = Field(None, validation_alias=AliasChoices("reasoning_content", "reasoning"))

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """Content given as ``[{"type": "text", "text": ...}, ...]`` is joined into one string."""
        if isinstance(v, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
                raise ValueError("content parts must all be {\"type\": \"text\", \"text\": <string>}; "
                                 "kdray models read text only")
            return "".join(p["text"] for p in v)
        return v

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        for name in ("tool_calls", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise FieldError((name,), f"only assistant messages carry {name}, not {self.role} messages")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise FieldError(("tool_call_id",), "a tool message needs the id of the tool call it answers" if
                             self.role == "tool" else f"only tool messages answer a tool call, not {self.role} ones")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError(("content",), "missing; only an assistant message with tool_calls may leave it out")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: tool-call arguments as objects (transformers' convention)."""
        out = self.model_dump(exclude_none=True)
        for call in out.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        return out


class FunctionDefinition(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False  # arguments exactly as the schema says: what a forced call's grammar always does


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(Strict):
    """``tool_choice`` naming the one function the reply calls."""

    type: Literal["function"]
    function: FunctionName


# Names a chat template is given by kdray itself, so chat_template_kwargs may not set them
TEMPLATE_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")


class ChatTemplateFields(Strict):
    """What a chat template renders: the messages, the tools and documents, and how the prompt ends."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    documents: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True  # end with the assistant's header
    continue_final_message: bool = False  # end inside the final (assistant) message, for the model to continue it
    chat_template_kwargs: dict[str, Any] = {}

    @model_validator(mode="after")
    def _template_fields(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError(("continue_final_message",), "excludes add_generation_prompt (true by default): set "
                             "add_generation_prompt to false to continue the final message")
        taken = sorted(set(self.chat_template_kwargs) & set(TEMPLATE_ARGUMENTS))
        if taken:
            raise FieldError(("chat_template_kwargs", taken[0]), "is a request field of its own; send it there")
        return self

    def template_arguments(self) -> dict:
        """Keyword arguments of ``Tokenizer.apply_chat_template`` (after the messages)."""
        tools = None if self.tools is None else [t.model_dump(exclude_unset=True) for t in self.tools]
        return {"tools": tools, "documents": self.documents, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, **self.chat_template_kwargs}


class ChatCompletionRequest(GenerationRequest, ChatTemplateFields):
    """``POST /v1/chat/completions``. Tool calls in the reply are parsed into ``tool_calls`` unless
    ``tool_choice`` is "none"."""

    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False  # report each token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # ... and the likeliest alternatives (needs logprobs)
    # "none", "auto", or forcing a call: "required" (one or, with parallel_tool_calls, more) or a NamedToolChoice
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # false: the reply's first tool call only
    include_reasoning: bool = True  # vLLM's: false leaves a thinking model's reasoning_content out of the reply
    # vLLM's: a thinking model's thought cut after this many tokens (0: closed in the prompt), then the reply answers
    thinking_token_budget: int | None = Field(None, ge=0, le=MAX_TOKENS)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> str | NamedToolChoice:
        if isinstance(v, str) and v in ("none", "auto", "required"):
            return v
        try:
            return NamedToolChoice.model_validate(v)
        except ValidationError:
            raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                             "{\"name\": <a tool's name>}}") from None

    @model_validator(mode="after")
    def _completion_tokens(self) -> ChatCompletionRequest:
        """The newer ``max_completion_tokens`` name wins over ``max_tokens`` when both are given."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.tool_choice not in (None, "none") and (self.tools is None or self.forces_tool_call and not self.tools):
            shown = self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.function.name
            raise FieldError(("tool_choice",), f"'{shown}' needs tools; send tools or leave it out")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in self.tool_names:
            raise FieldError(("tool_choice",), f"names function '{self.tool_choice.function.name}', which tools do "
                                               f"not declare (they declare {self.tool_names})")
        strict = [i for i, t in enumerate(self.tools or []) if t.function.strict]
        if strict and not self.forces_tool_call:
            raise FieldError(("tools", strict[0], "function", "strict"), "kdray constrains arguments only where "
                             "tool_choice forces a call ('required' or a named function); leave strict out or force "
                             "the call")
        if self.forces_tool_call and self.response_format is not None and self.response_format.type != "text":
            raise FieldError(("response_format",), "does not apply to a reply that tool_choice forces to be tool "
                                                   "calls; leave one of them out")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError(("top_logprobs",), "needs logprobs: true; send it or leave top_logprobs out")
        if self.thinking_token_budget:  # the cut thought's continuation is a request of its own
            taken = [name for name, on in (("n", self.n > 1), ("logprobs", self.logprobs),
                                           ("min_tokens", self.min_tokens)) if on]
            if taken:
                raise FieldError(("thinking_token_budget",), f"kdray cuts a thought for one sample without "
                                 f"log-probabilities or min_tokens; leave out {taken[0]} or the budget")
        return self

    @property
    def reported_logprobs(self) -> int | None:
        """Alternatives per token the engine reports (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def parses_tool_calls(self) -> bool:
        return self.tools is not None and self.tool_choice != "none"

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def constrained(self) -> bool:
        return self.forces_tool_call or super().constrained

    def forced_calls(self) -> tuple[list[FunctionDefinition], bool]:
        """The functions a forced reply calls, and whether it may call several."""
        if isinstance(self.tool_choice, NamedToolChoice):
            named = self.tool_choice.function.name
            return [t.function for t in self.tools if t.function.name == named], False
        return [t.function for t in self.tools], self.parallel_tool_calls


class TokenizeCompletionRequest(Strict):
    """``POST /tokenize`` with a prompt: its token ids, as /v1/completions would use them."""

    model: str | None = None
    prompt: str


class TokenizeChatRequest(ChatTemplateFields):
    """``POST /tokenize`` with messages: the chat template's prompt as /v1/chat/completions would use it."""

    model: str | None = None


class DetokenizeRequest(Strict):
    """``POST /detokenize``: the text of token ids."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None
          ) -> dict:
    """OpenAI's usage: with the prompt tokens the prefix cache held, and for a thinking model how many of the
    completion's tokens were reasoning."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
