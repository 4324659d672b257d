"""OpenAI completions and chat completions on an :class:`AsyncEngine`.

A request becomes ``len(prompts) * n`` engine requests (choice ``i * n + j`` is prompt ``i``'s
``j``-th sample); their outputs become one response body, or a stream of SSE chunks. Chat prompts are rendered
(and all prompts tokenized) in a worker thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from kdray.actors.channel import WorkerFailure
from kdray.engine.engine import RunnerFailure
from kdray.engine.request import CompletionOutput, Logprob, RequestOutput, SamplingParams, join_output, stop_hold
from kdray.model.tokenizer import ChatTemplateError
from kdray.serve.async_engine import AsyncEngine, EngineDead, EngineRestarted, QueueFull, RequestStream
from kdray.serve.protocol import (SSE_DONE, APIError, ChatCompletionRequest, ChatTemplateFields, CompletionRequest,
                                  DetokenizeRequest, GenerationRequest, TokenizeChatRequest, TokenizeCompletionRequest,
                                  sse, usage, validate)
from kdray.serve.reasoning import ReasoningFormat, ReasoningSplit
from kdray.serve.thought_budget import BudgetedThought
from kdray.serve.tool_calls import ParsedCall, ToolCallParser, ToolText
from kdray.spec.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("kdray.serve")
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def api_error(e: Exception, where: str) -> APIError:
    """The OpenAI error for an exception raised while serving ``where``: a 4xx the client can fix, a 503 worth
    retrying, or a 500 whose details stay in the replica's log (never in the body)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(503, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)},
                        type="server_overloaded")
    if isinstance(e, EngineDead):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, EngineRestarted):
        return APIError(503, str(e), code="engine_restarted", headers={"Retry-After": "1"})
    if isinstance(e, WorkerFailure):
        return APIError(503, "a shard of the engine failed while serving this request; the engine is starting "
                        "new ones: send it again", code="worker_failed", headers={"Retry-After": "1"})
    ref = uuid.uuid4().hex[:12]
    logger.error("%s failed (error %s)", where, ref, exc_info=e)
    what = "the engine step serving this request failed" if isinstance(e, RunnerFailure) else "internal error"
    return APIError(500, f"{what}; the replica's log has the details under error {ref}", code="internal_error")


class OpenAIServing:
    """Turns validated OpenAI requests into engine requests and engine outputs into OpenAI bodies."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.tool_calls = ToolCallParser(self.tokenizer) if self.tokenizer is not None else None
        self.reasoning = ReasoningFormat.of(self.tokenizer)  # None: the model does not think

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "kdray", "max_model_len": self.max_model_len}]}

    async def completions(self, data: dict) -> dict | AsyncIterator[str]:
        """``POST /v1/completions``: a response body, or SSE text when ``stream`` is true."""
        arrived = time.perf_counter()
        req = validate(CompletionRequest, data)
        self.check_model(req.model)
        self._check_size(len(req.prompt), req.n)
        prompts = await asyncio.to_thread(lambda: [p if isinstance(p, list) else self._encode(p) for p in req.prompt])
        echo = None
        if req.echo:  # the prompts' text, before each choice's
            echo = await asyncio.to_thread(lambda: [p if isinstance(p, str) else self._decode(p, "echo")
                                                    for p in req.prompt])
        return await self._finish(req, *await self._submit(req, prompts, chat=False, echo=echo), arrived)

    async def chat(self, data: dict) -> dict | AsyncIterator[str]:
        """``POST /v1/chat/completions``: the prompt is the tokenizer's chat template over ``messages`` (and
        ``tools``, ``documents``, ...); tool calls in the reply are parsed unless ``tool_choice`` is "none"."""
        arrived = time.perf_counter()
        req = validate(ChatCompletionRequest, data)
        return await self._finish(req, *await self.submit_chat(req), arrived)

    async def submit_chat(self, req: ChatCompletionRequest) -> tuple[OpenAIResponse, RequestStream, list[str]]:
        """A validated chat request sent to the engine: its response shapes, its stream, its engine request ids (a
        ``thinking_token_budget`` of 0 closes the thought in the prompt, more cut it: :class:`BudgetedThought`)."""
        self.check_model(req.model)
        self._check_size(1, req.n)
        for name, given in (("include_reasoning", not req.include_reasoning),
                            ("thinking_token_budget", req.thinking_token_budget is not None)):
            if given and self.reasoning is None:
                raise APIError(400, f"{name}: model '{self.model_name}' does not think (its chat template writes no "
                               "<think>), so its replies have no reasoning; leave the field out", param=name,
                               code="invalid_value")
        budget = req.thinking_token_budget
        ids = await self.prompt(req, close_thought=budget == 0)
        tools = self.tool_calls if req.parses_tool_calls else None
        thought = None if self.reasoning is None else _Thought(self.reasoning, self.reasoning.opened(ids),
                                                                 req.include_reasoning)
        return await self._submit(req, [ids], chat=True, tools=tools, thought=thought, thought_budget=budget)

    async def prompt(self, req: ChatTemplateFields, close_thought: bool = False) -> list[int]:
        """The chat prompt's token ids (rendered off the event loop); ``close_thought``: a thinking model's thought
        closed at once (``</think>``, after ``<think>`` unless the template opened it), so the reply answers."""
        ids = await asyncio.to_thread(self._render, req)
        if close_thought and self.reasoning is not None:
            ids += ([] if self.reasoning.opened(ids) else [self.reasoning.think]) + [self.reasoning.think_end]
        return ids

    async def tokenize(self, data: dict) -> dict:
        """``POST /tokenize`` (vLLM's): the token ids of a ``prompt``, or of ``messages`` rendered for chat."""
        req = validate(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = await self.prompt(req)
        else:
            ids = await asyncio.to_thread(self._encode, req.prompt)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}

    async def detokenize(self, data: dict) -> dict:
        """``POST /detokenize`` (vLLM's): the text of ``tokens``."""
        req = validate(DetokenizeRequest, data)
        self.check_model(req.model)
        vocab = self.engine.engine.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens: ids must lie in [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(self._decode, req.tokens, "tokens")}

    def _check_size(self, prompts: int, n: int):
        if prompts * n > self.engine.capacity:
            raise APIError(400, f"n: {prompts} prompts x n={n} make {prompts * n} requests, more than this server "
                           f"takes at once ({self.engine.capacity}); split the request", param="n")

    def check_model(self, model: str | None):
        if model is not None and model != self.model_name:
            raise APIError(400, f"model: '{model}' is not served here; this server serves '{self.model_name}' "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, f"prompt: model '{self.model_name}' has no tokenizer; send the prompt as a list of "
                           "token ids", param="prompt", code="tokenizer_missing")
        return self.tokenizer.encode(text)

    def _decode(self, ids: list[int], field: str) -> str:
        if self.tokenizer is None:
            raise APIError(400, f"{field}: model '{self.model_name}' has no tokenizer, so token ids have no text",
                           param=field, code="tokenizer_missing")
        return self.tokenizer.decode(ids)

    def _token_text(self, token: int) -> str:
        """One token's text in log-probabilities (``token_id:<id>`` for a model without a tokenizer, as vLLM)."""
        return f"token_id:{token}" if self.tokenizer is None else self.tokenizer.decode([token])

    def _render(self, req: ChatTemplateFields) -> list[int]:
        """The chat prompt's token ids: the chat template over the request's messages, tools, ..."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, f"messages: model '{self.model_name}' has no tokenizer with a chat template, so it "
                           "cannot serve chat completions; use /v1/completions (with token ids when it has no "
                           "tokenizer)",
                           param="messages", code="chat_template_missing")
        try:
            text = self.tokenizer.apply_chat_template([m.for_template() for m in req.messages],
                                                      **req.template_arguments())
        except ChatTemplateError as e:  # the template's own error, or the sandbox stopping it
            raise APIError(400, f"messages: {e}", param="messages", code="chat_template_error") from None
        except ValueError as e:  # what continue_final_message needs
            raise APIError(400, str(e), param="continue_final_message" if req.continue_final_message else "messages",
                           code="chat_template_error") from None
        given = [i for i, m in enumerate(req.messages) if m.reasoning_content is not None]
        if given and "reasoning_content" not in self.tokenizer.template_source(req.template_arguments()["tools"]):
            field = f"messages[{given[0]}].reasoning_content"
            raise APIError(400, f"{field}: the chat template of model '{self.model_name}' does not read it; leave it "
                           "out", param=field, code="invalid_value")
        return self.tokenizer.encode(text)

    def _grammars(self, req: GenerationRequest, thought: _Thought | None
                  ) -> tuple[StructuredOutputsParams, StructuredOutputsParams]:
        """A constrained request's grammars: its answer's (``response_format``, or ``tool_choice`` forcing a call in
        the model's tool-call format), and the reply's (that answer after a thinking model's reasoning), compiled
        here (run it off the event loop): one that does not compile is a 400 naming its field, and the engine finds
        them compiled."""
        if isinstance(req, ChatCompletionRequest) and req.forces_tool_call:
            functions, several = req.forced_calls()
            grammar = StructuredOutputsParams(structural_tag=self.tool_calls.grammar(
                [(f.name, f.parameters) for f in functions], several))
            field, what = "tool_choice", "forcing a call needs the tools' parameters as a grammar, and "
        else:
            grammar, field, what = req.response_format.structured_outputs(), "response_format", ""
        try:
            self.engine.engine.grammars.compile(grammar)
        except ValueError as e:
            raise APIError(400, f"{field}: {what}{e}", param=field, code="invalid_value") from None
        if thought is None:
            return grammar, grammar
        reply = thought.format.grammar(grammar, thought.opened)
        self.engine.engine.grammars.compile(reply)
        return grammar, reply

    def _max_tokens(self, req: GenerationRequest, prompt_len: int, chat: bool) -> int:
        field = "messages" if chat else "prompt"
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"{field}: {prompt_len} tokens leave no room in the context of {self.max_model_len} "
                           "tokens; shorten it", param=field, code="context_length_exceeded")
        if req.max_tokens is None:  # the default, clamped to the room left (as vLLM does)
            return room if chat else min(room, DEFAULT_COMPLETION_TOKENS)
        wanted = req.max_tokens
        if wanted > room:
            raise APIError(400, f"max_tokens: {wanted} new tokens plus the {prompt_len}-token prompt exceed the "
                           f"context of {self.max_model_len}; ask for at most {room}", param="max_tokens",
                           code="context_length_exceeded")
        return wanted

    async def _submit(self, req: GenerationRequest, prompts: list[list[int]], chat: bool,
                      echo: list[str] | None = None, tools: ToolCallParser | None = None,
                      thought: _Thought | None = None, thought_budget: int | None = None
                      ) -> tuple[OpenAIResponse, RequestStream, list[str]]:
        """The engine's requests for ``prompts`` sent: their response shapes, their stream and ids (``thought``: how a
        thinking model's chat reply starts; ``thought_budget``: its most tokens, for one sample without
        log-probabilities; 0: the prompt closed it, and a grammar holds the whole reply)."""
        if req.stop and self.tokenizer is None:
            raise APIError(400, f"stop: model '{self.model_name}' has no tokenizer, so stop strings cannot match; "
                           "leave the field out", param="stop")
        free = thought if thought_budget != 0 else None  # the thought a grammar lets run before it
        answer = grammar = None
        if req.constrained:
            answer, grammar = await asyncio.to_thread(self._grammars, req, free)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        requests = []
        for i, ids in enumerate(prompts):
            max_tokens = self._max_tokens(req, len(ids), chat)
            if req.min_tokens > max_tokens:
                raise APIError(400, f"min_tokens: {req.min_tokens} is more than max_tokens ({max_tokens}); lower it",
                               param="min_tokens")
            for j in range(req.n):  # max_tokens 0 (echo): the prefill's token is drawn, then dropped (as vLLM)
                params = SamplingParams(max_tokens=max(max_tokens, 1), temperature=req.temperature, top_p=req.top_p,
                                        top_k=max(req.top_k, 0), seed=None if req.seed is None else req.seed + j,
                                        stop=req.stop, stop_token_ids=req.stop_token_ids,
                                        include_stop_str_in_output=req.include_stop_str_in_output,
                                        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, min_p=req.min_p,
                                        presence_penalty=req.presence_penalty,
                                        frequency_penalty=req.frequency_penalty,
                                        repetition_penalty=req.repetition_penalty, logit_bias=req.token_bias,
                                        logprobs=req.reported_logprobs, prompt_logprobs=req.reported_prompt_logprobs,
                                        structured_outputs=grammar)
                requests.append((f"{rid}-{i * req.n + j}", ids, params))
        response = OpenAIResponse(rid, self.model_name, chat, req, len(requests), sum(map(len, prompts)), echo,
                                  tools, self._token_text, thought)
        budgeted = bool(thought_budget) and thought is not None
        if budgeted:
            (request,) = requests
            assert request[2].logprobs is None and not request[2].min_tokens, "a budget's cut keeps neither"
        try:
            stream = await self.engine.generate(requests)
        except ValueError as e:  # the engine refused the prompt, or a field ("<field>: why")
            name = str(e).split(":")[0]
            if name in type(req).model_fields:
                raise APIError(400, str(e), param=name, code="invalid_value") from None
            raise APIError(400, str(e), code="invalid_prompt") from None
        if budgeted:  # the continuation's grammar holds the answer alone
            stream = BudgetedThought(self.engine.generate, stream, request, thought.format, thought.opened,
                                     thought_budget, replace(request[2], structured_outputs=answer))
        return response, stream, [r[0] for r in requests]

    async def _finish(self, req: GenerationRequest, response: OpenAIResponse, stream: RequestStream, ids: list[str],
                      arrived: float) -> dict | AsyncIterator[str]:
        """The response body of a submitted request, or its SSE text (``arrived``: when the handler began)."""
        if req.stream:
            return response.sse(stream, self.first_token(arrived))
        return response.body(await collect(stream, ids))

    def first_token(self, arrived: float) -> Callable[[], None]:
        """What a stream calls as its first token goes out: the server-side time to first token is observed."""
        ttft = self.engine.metrics.server_ttft
        return lambda: ttft.observe(time.perf_counter() - arrived)


async def respond(handler: Callable[[dict], Awaitable[dict]], body: dict,
                  error_body: Callable[[APIError], dict] = APIError.body) -> tuple[int, dict]:
    """One request answered whole as ``(status, body)`` (what a batch job records per line): a 4xx's body in
    ``error_body``'s shape (its API's)."""
    if body.get("stream"):
        err = APIError(400, "stream: batch requests cannot stream; leave it out", param="stream")
        return err.status, error_body(err)
    try:
        return 200, await handler(body)
    except APIError as e:
        return e.status, error_body(e)


async def collect(stream: RequestStream, ids: list[str]) -> list[RequestOutput]:
    """The whole outputs of engine requests ``ids`` from their stream (aborted at the end, whatever happens)."""
    try:
        whole: dict[str, RequestOutput] = {}
        async for out in stream:
            join_output(whole, out)
    finally:
        stream.abort()
    return [whole[i] for i in ids]


@dataclass
class _Thought:
    """How a thinking model's chat reply starts: the model's markers, whether the prompt opened the thought, and
    whether the reply shows the reasoning (``include_reasoning``)."""

    format: ReasoningFormat
    opened: bool
    shown: bool


@dataclass
class Sent:
    """What a stream has sent of one choice (or what a whole body has read of it): its text, its token ids, and per
    tool call its id and arguments."""

    text: str = ""
    reasoning: str = ""  # the reasoning's text
    ids: int = 0
    cached: int = 0  # prompt tokens the prefix cache held
    calls: list[list] = field(default_factory=list)  # [id, characters of arguments sent]
    offset: int = 0  # characters of the tokens whose log-probabilities are sent (completions' text_offset)
    echoed: bool = False  # the prompt's text (and log-probabilities) sent
    tool_text: ToolText | None = None  # with tools: the reply's text so far, decoded as it grows
    split: ReasoningSplit | None = None  # a thinking model's: where the reasoning ends, found as the reply grows


class OpenAIResponse:
    """The OpenAI body shapes of one request: a whole response or its SSE chunks."""

    def __init__(self, rid: str, model: str, chat: bool, req: GenerationRequest, choices: int, prompt_tokens: int,
                 echo: list[str] | None = None, tools: ToolCallParser | None = None,
                 token_text: Callable[[int], str] = str, thought: _Thought | None = None):
        self.rid, self.model, self.chat, self.choices, self.prompt_tokens = rid, model, chat, choices, prompt_tokens
        self.top, self.token_text = req.reported_logprobs, token_text
        self.token_ids, self.include_usage = req.return_token_ids, req.include_usage
        self.hold = stop_hold(req.stop)
        self.echo = None if echo is None else [text for text in echo for _ in range(req.n)]  # per choice
        self.n = req.n
        self.generates = req.max_tokens != 0  # 0 (echo): the prompt alone
        self.tools, self.thought = tools, thought
        self.max_calls = None if getattr(req, "parallel_tool_calls", True) else 1
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _chunks(self, obj: str) -> Callable[[dict], str]:
        """The SSE event of a chunk of one choice, its head (id, object, created, model) encoded once per stream."""
        head = sse({**self._head(obj), "choices": []})[:-len("]}\n\n")]
        return lambda choice: f"{head}{sse(choice)[len('data: '):-2]}]}}\n\n"

    def _choice(self, index: int, text: str | None, token_ids: list[int], finish: str | None, delta: bool,
                tool_calls: list[dict] | None = None, logprobs: dict | None = None, reasoning: str | None = None,
                stop_reason: int | str | None = None) -> dict:
        """One choice's body (or, ``delta``, its chunk); once finished, with vLLM's ``stop_reason``: the stop string
        or stop token id that ended it."""
        if not self.chat:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        else:
            message = {} if delta else {"role": "assistant", "content": text}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if delta and text:
                message["content"] = text
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": index, "delta" if delta else "message": message, "logprobs": logprobs,
                      "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if self.token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _reply(self, c: CompletionOutput, finished: bool, sent: Sent
               ) -> tuple[str | None, str, list[ParsedCall], str | None]:
        """A choice's reasoning (None: it does not think), content, tool calls and finish reason so far: with tools,
        the content's text before the calls (all of it when the finished reply has none) and finish reason
        "tool_calls" when it has. ``sent``: the choice's, whose :class:`ToolText` and :class:`ReasoningSplit` read
        only the ids they have not seen."""
        reasoning, text, start = None, c.text, 0  # start: the content's first id (None: still reasoning)
        if self.thought is not None:
            sent.split = sent.split or ReasoningSplit(self.thought.format, self.thought.opened)
            sent.split.feed(c.token_ids)
            reasoning, text = sent.split.texts(c.text, c.token_ids)
            start = sent.split.content
        if self.tools is None or start is None:
            return reasoning, text, [], c.finish_reason
        sent.tool_text = sent.tool_text or ToolText(self.tools, start)
        reply = self.tools.parse(sent.tool_text.text(c.token_ids, finished), finished, sent.tool_text.first_call())
        calls = reply.calls[:self.max_calls]
        if not finished:
            return reasoning, reply.content, calls, None
        done = [call for call in calls if call.complete]
        if done:
            return reasoning, reply.content, done, "tool_calls"
        if sent.calls:  # a stream that sent a call cut short (finish "length") does not send its text as content too
            return reasoning, reply.content, [], c.finish_reason
        return reasoning, text, [], c.finish_reason

    def sample(self, out: RequestOutput) -> CompletionOutput:
        """A choice's sample as answered: with ``max_tokens`` 0, none of it (the token the engine drew is dropped)."""
        c = out.outputs[0]
        return c if self.generates else replace(c, text="", token_ids=[], cumulative_logprob=None,
                                                logprobs=None if c.logprobs is None else [])

    def _echoed(self, out: RequestOutput) -> tuple[list[int], list]:
        """The prompt's tokens and log-probabilities that lead a choice's (echo with logprobs), else none."""
        return (out.prompt_token_ids, out.prompt_logprobs) if self.echo and self.top is not None else ([], [])

    def body(self, outputs: list[RequestOutput]) -> dict:
        choices, read = [], [Sent() for _ in outputs]
        for index, (out, sent) in enumerate(zip(outputs, read)):
            c = self.sample(out)
            sent.ids, sent.cached = len(c.token_ids), out.num_cached_tokens
            reasoning, text, calls, finish = self._reply(c, True, sent)
            if self.echo:
                text = self.echo[index] + text
            tool_calls = [_tool_call(call, call.id or _call_id()) for call in calls]
            ids, found = self._echoed(out)
            logprobs = self._logprobs(ids + c.token_ids, found + (c.logprobs or []), sent)
            choices.append(self._choice(index, (text or None) if calls else text, c.token_ids, finish, False,
                                        tool_calls, logprobs, self._shown(reasoning), c.stop_reason))
            if self.token_ids:
                choices[-1]["prompt_token_ids"] = out.prompt_token_ids
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": self._usage(read)}

    def _usage(self, sent: list[Sent]) -> dict:
        """The usage of the choices read (``sent``): each prompt counted once (its first choice's cached tokens),
        and a thinking model's reasoning tokens."""
        reasoning = None if self.thought is None else sum(s.split.tokens for s in sent if s.split is not None)
        return usage(self.prompt_tokens, sum(s.ids for s in sent), sum(s.cached for s in sent[::self.n]), reasoning)

    def _shown(self, reasoning: str | None) -> str | None:
        """The reasoning a reply shows: none when the request leaves it out (``include_reasoning``: false)."""
        return reasoning if self.thought is not None and self.thought.shown else None

    def delta(self, c: CompletionOutput, finished: bool, sent: Sent
               ) -> tuple[str | None, str, list[dict], str | None]:
        """What a choice adds to what its stream has sent: reasoning (None: none), text, tool-call deltas, the finish
        reason.

        A running request's text is sent only as far as it is settled: not a tail that could still become a stop
        string (which is cut from the output) nor half a UTF-8 character (the engine's text is; the text of a reply
        with tools, decoded here, is held back here). A tool call is sent with its id and name, then its arguments
        as they grow."""
        reasoning, content, calls, finish = self._reply(c, finished, sent)
        thought = None
        if (reasoning := self._shown(reasoning)) is not None and len(reasoning) > len(sent.reasoning):
            thought, sent.reasoning = reasoning[len(sent.reasoning):], reasoning
        if not finished and self.tools is not None:  # the engine holds back its own text; this one is made here
            content = content[:len(content) - self.hold].rstrip("\ufffd")
        text = content[len(sent.text):]
        if text:
            sent.text = content
        deltas = []
        for i, call in enumerate(calls):
            new = i == len(sent.calls)
            if new:
                sent.calls.append([call.id or _call_id(), 0])
            arguments = call.arguments[sent.calls[i][1]:]
            sent.calls[i][1] = len(call.arguments)
            if new:
                deltas.append(_tool_call(call, sent.calls[i][0], arguments, index=i))
            elif arguments:
                deltas.append({"index": i, "function": {"arguments": arguments}})
        return thought, text, deltas, finish

    def _logprobs(self, tokens: list[int], logprobs: list[dict[int, Logprob] | None], sent: Sent) -> dict | None:
        """The log-probabilities of ``tokens`` (each one's ``{token id: Logprob}``; None for a prompt's first, which
        has none) in OpenAI's shape (None when not asked): completions' ``{tokens, token_logprobs, top_logprobs,
        text_offset}`` (``sent.offset`` advanced), chat's ``{content: [{token, logprob, bytes, top_logprobs}]}``."""
        if self.top is None:
            return None
        rows = []  # per token: its text, its logprob and its top alternatives [(text, logprob)], best first
        for token, found in zip(tokens, logprobs):
            if found is None:  # the prompt's first token: null, as OpenAI answers
                rows.append((self.token_text(token), None, None))
                continue
            top = sorted((lp.rank, t, lp.logprob) for t, lp in found.items()  # completions: the token's too
                         if lp.rank <= self.top or (t == token and not self.chat))
            rows.append((self.token_text(token), _finite(found[token].logprob),
                         [(self.token_text(t), _finite(v)) for _, t, v in top]))
        if self.chat:
            return {"content": [{**_entry(text, value), "top_logprobs": [_entry(*alt) for alt in top]}
                                for text, value, top in rows]}
        offsets = []
        for text, _, _ in rows:
            offsets.append(sent.offset)
            sent.offset += len(text)
        return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [None if r[2] is None else dict(r[2]) for r in rows], "text_offset": offsets}

    async def sse(self, stream: RequestStream, first_token: Callable[[], None]) -> AsyncIterator[str]:
        """SSE text: per choice, the role first (chat) or, with its first output, the echoed prompt (and its
        log-probabilities), then deltas, then the finish reason; ``first_token()`` is called as the first chunk
        with a generated token goes out."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = self._chunks(obj)
        sent = [Sent() for _ in range(self.choices)]
        whole: dict[str, RequestOutput] = {}  # per choice: its outputs joined
        try:
            for index in range(self.choices):
                if self.chat:
                    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
                    yield chunk(first)
            async for added in stream:
                index = int(added.request_id.rsplit("-", 1)[1])
                out = join_output(whole, added)
                sent[index].cached = out.num_cached_tokens
                if self.echo and not sent[index].echoed:
                    sent[index].echoed = True
                    logprobs = self._logprobs(*self._echoed(out), sent[index])
                    choice = self._choice(index, self.echo[index], [], None, True, logprobs=logprobs)
                    yield chunk(choice)
                c = self.sample(out)
                thought, text, tool_calls, finish = self.delta(c, out.finished, sent[index])
                ids = c.token_ids[sent[index].ids:]
                logprobs = self._logprobs(ids, (c.logprobs or [])[sent[index].ids:], sent[index])
                sent[index].ids = len(c.token_ids)
                if text or ids or tool_calls or finish or thought:
                    choice = self._choice(index, text, ids, finish, True, tool_calls, logprobs, thought,
                                          c.stop_reason)
                    yield chunk(choice)
                    if ids and first_token is not None:
                        first_token()
                        first_token = None
            if self.include_usage:
                yield sse({**self._head(obj), "choices": [], "usage": self._usage(sent)})
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - the status line is gone: report the error in the stream
            yield sse(api_error(e, "a stream").body())
        finally:
            stream.abort()


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry (vLLM's floor for -inf)."""
    return max(logprob, -9999.0)


def _entry(text: str, logprob: float) -> dict:
    """A chat log-probability entry: the token's text, its log-probability and its UTF-8 bytes."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(call: ParsedCall, call_id: str, arguments: str | None = None, index: int | None = None) -> dict:
    """A tool call as OpenAI writes it (a stream's first delta of it has ``index`` and the arguments so far)."""
    out = {"id": call_id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments if arguments is None else arguments}}
    return out if index is None else {"index": index, **out}
