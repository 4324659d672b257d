"""OpenAI request handling without a server: how many tokens a request may generate, what reaches the chat
template (and what a template error answers), tokenization off the event loop, and which error (status, type,
code) each failure becomes."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from kdray.actors.channel import WorkerFailure
from kdray.engine.engine import RunnerFailure
from kdray.model.tokenizer import TiktokenBackend, Tokenizer
from kdray.serve.async_engine import EngineDead, EngineRestarted, QueueFull
from kdray.serve.protocol import METADATA_FIELDS, APIError, ChatCompletionRequest, CompletionRequest, sse, validate
from kdray.serve.serving import DEFAULT_COMPLETION_TOKENS, OpenAIServing, OpenAIResponse, api_error

CONTEXT = 64


def serving() -> OpenAIServing:
    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=None, max_model_len=CONTEXT))
    return OpenAIServing(engine, "m")


def test_a_completion_without_max_tokens_takes_what_is_left_when_that_is_less_than_the_default():
    req = CompletionRequest(model="m", prompt=[1])
    room = 5
    assert room < DEFAULT_COMPLETION_TOKENS
    assert serving()._max_tokens(req, CONTEXT - room, chat=False) == room
    assert serving()._max_tokens(req, 3, chat=False) == DEFAULT_COMPLETION_TOKENS


def test_chat_without_max_tokens_takes_the_rest_of_the_context():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert serving()._max_tokens(req, 10, chat=True) == CONTEXT - 10


def test_an_explicit_max_tokens_beyond_the_room_is_refused_naming_it():
    with pytest.raises(APIError, match="max_tokens: 16 new tokens") as e:
        serving()._max_tokens(CompletionRequest(model="m", prompt=[1], max_tokens=16), CONTEXT - 5, chat=False)
    assert e.value.param == "max_tokens"
    with pytest.raises(APIError, match="leave no room") as e:
        serving()._max_tokens(CompletionRequest(model="m", prompt=[1]), CONTEXT, chat=False)
    assert e.value.param == "prompt"


# ---------------------------------------------------------------- chat templates from requests

BYTES = {bytes([b]): b for b in range(256)}
USER = {"role": "user", "content": "Weather in Paris?"}
CALLED = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "12°C"}


def serving_with_template(template: str) -> OpenAIServing:
    tok = Tokenizer(TiktokenBackend(BYTES, {}), chat_template=template)
    return OpenAIServing(SimpleNamespace(engine=SimpleNamespace(tokenizer=tok, max_model_len=CONTEXT), capacity=4), "m")


def rendered(serving: OpenAIServing, **fields) -> str:
    ids = asyncio.run(serving.tokenize({"messages": [USER, CALLED, RESULT], **fields}))["tokens"]
    return serving.tokenizer.decode(ids)


def test_tools_documents_and_template_arguments_reach_the_template():
    template = ("{{ tools | length }} {{ documents[0].title }} {{ greeting }} "
                "{{ messages[1].tool_calls[0].function.arguments.city }} {{ messages[2].tool_call_id }} "
                "{{ add_generation_prompt }}")
    fields = {"tools": [{"type": "function", "function": {"name": "get_weather"}}],
              "documents": [{"title": "Atlas", "text": "Paris is in France."}],
              "chat_template_kwargs": {"greeting": "hi"}}
    assert rendered(serving_with_template(template), **fields) == "1 Atlas hi Paris call_1 True"
    assert rendered(serving_with_template(template), **fields, add_generation_prompt=False).endswith("False")


@pytest.mark.parametrize("template,message", [
    ("{{ raise_exception('tool results need a name') }}", "messages: chat template: tool results need a name"),
    ("{{ cycler.__init__.__globals__.os.system('touch %s') }}", "messages: chat template was stopped by the sandbox"),
    ("{% for m in messages %}", "messages: chat template has a syntax error"),
])
def test_template_errors_and_sandbox_violations_are_400s_naming_them(tmp_path, template, message):
    marker = tmp_path / "escaped"
    serving = serving_with_template(template.replace("%s", str(marker)))
    for call in (serving.chat({"model": "m", "messages": [USER]}), serving.tokenize({"messages": [USER]})):
        with pytest.raises(APIError, match=message) as e:
            asyncio.run(call)
        assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "chat_template_error")
    assert not marker.exists()


# ---------------------------------------------------------------- strict by default (the walk over every field is
# tests/test_openai_fields.py, on a served model)

@pytest.mark.parametrize("model,fields,param,message", [
    (CompletionRequest, {"prediction": {"type": "content"}}, "prediction", "kdray does not implement this field"),
    (CompletionRequest, {"suffix": "!"}, "suffix", "fill-in-the-middle"),
    (CompletionRequest, {"best_of": 2}, "best_of", r"must equal n \(1\)"),
    (CompletionRequest, {"stream_options": {"include_usage": True}}, "stream_options", "only applies with stream"),
    (CompletionRequest, {"stop_token_ids": [1] * 65}, "stop_token_ids", "at most 64 items"),
    (ChatCompletionRequest, {"tools": [], "tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    (ChatCompletionRequest, {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
     "tools[0].function.strict", "only where tool_choice forces a call"),
    (ChatCompletionRequest, {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing"),
    (CompletionRequest, {"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens",
     "cannot be combined with a grammar"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages[0].audio",
     "kdray does not implement this field"),
    (ChatCompletionRequest, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools",
     "a request field of its own"),
])
def test_what_kdray_does_not_honour_is_a_400_naming_it(model, fields, param, message):
    body = {"model": "m", "prompt": "x"} if model is CompletionRequest else {"model": "m", "messages": [USER]}
    with pytest.raises(APIError, match=message) as e:
        validate(model, {**body, **fields})
    assert (e.value.status, e.value.param) == (400, param)


def test_metadata_fields_are_accepted():
    fields = {"user": "client-7", "safety_identifier": "client-7", "metadata": {"team": "a"}}
    assert set(fields) == set(METADATA_FIELDS)
    assert validate(CompletionRequest, {"model": "m", "prompt": "x", **fields}).user == "client-7"


class BlockingTokenizer(Tokenizer):
    """``encode`` waits until ``release`` is set: only a tokenizer run off the event loop lets the loop set it."""

    def __init__(self):
        super().__init__(TiktokenBackend(BYTES, {}))
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        if not self.release.wait(timeout=10):
            raise TimeoutError("the event loop was blocked while tokenizing")
        return [1, 2, 3]


def test_tokenization_runs_off_the_event_loop():
    tokenizer = BlockingTokenizer()
    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer, max_model_len=CONTEXT), capacity=4)
    server = OpenAIServing(engine, "m")

    async def submit(req, prompts, chat, echo):  # stop before the engine, showing the prompts
        raise Submitted(prompts)

    async def scenario():
        server._submit = submit
        pending = asyncio.ensure_future(server.completions({"model": "m", "prompt": "a long text"}))
        await asyncio.sleep(0.05)  # the loop runs while the tokenizer works
        tokenizer.release.set()
        return await pending

    with pytest.raises(Submitted) as e:
        asyncio.run(scenario())
    assert e.value.args[0] == [[1, 2, 3]]


class Submitted(Exception):
    """What a stub of the engine's submission raises: the prompts it was given."""


@pytest.mark.parametrize("error,status,kind,code", [
    (QueueFull(8, retry_after=7), 503, "server_overloaded", "queue_full"),
    (EngineDead("the engine failed and could not be reset"), 503, "server_error", "engine_dead"),
    (EngineRestarted("send it again"), 503, "server_error", "engine_restarted"),
    (WorkerFailure("shard 1 died (its channel closed)", ("r",)), 503, "server_error", "worker_failed"),
    (RunnerFailure("the step failed (ValueError: boom)", ("r",)), 500, "server_error", "internal_error"),
    (RuntimeError("secret detail"), 500, "server_error", "internal_error"),
])
def test_errors_are_typed_and_carry_no_exception_text(error, status, kind, code):
    err = api_error(error, "/v1/completions")
    body = err.body()["error"]
    assert (err.status, body["type"], body["code"]) == (status, kind, code)
    assert "secret detail" not in body["message"] and "Error(" not in body["message"]
    if code == "queue_full":
        assert err.headers["Retry-After"] == "7"


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_chunk_is_the_event_of_its_whole_body(chat):
    """The chunk events, their head encoded once per stream, are what ``sse`` makes of the whole chunk body."""
    req = validate(ChatCompletionRequest if chat else CompletionRequest,
                   {"model": 'm "1"\u2028', "stream": True, **({"messages": [{"role": "user", "content": "hi"}]}
                                                              if chat else {"prompt": "hi"})})
    response = OpenAIResponse('cmpl-"é"', 'm "1"\u2028', chat, req, 1, 3)
    obj = "chat.completion.chunk" if chat else "text_completion"
    choice = {"index": 0, "delta": {"content": 'a"\n\\😀\u2028'}, "logprobs": None, "finish_reason": None}
    assert response._chunks(obj)(choice) == sse({**response._head(obj), "choices": [choice]})
