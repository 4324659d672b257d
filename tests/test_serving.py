"""OpenAI request handling without a server: how many tokens a request may generate, tokenization off the
event loop, and which error (status, type, code) each failure becomes."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from kdray.actors.channel import WorkerFailure
from kdray.engine.engine import RunnerFailure
from kdray.serve.async_engine import EngineDead, EngineRestarted, QueueFull
from kdray.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kdray.serve.serving import DEFAULT_COMPLETION_TOKENS, OpenAIServing, api_error

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


class BlockingTokenizer:
    """``encode`` waits until ``release`` is set: only a tokenizer run off the event loop lets the loop set it."""

    chat_template = None

    def __init__(self):
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        if not self.release.wait(timeout=10):
            raise TimeoutError("the event loop was blocked while tokenizing")
        return [1, 2, 3]


def test_tokenization_runs_off_the_event_loop():
    tokenizer = BlockingTokenizer()
    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer, max_model_len=CONTEXT), capacity=4)
    server = OpenAIServing(engine, "m")

    async def scenario():
        server._generate = lambda req, prompts, chat: asyncio.sleep(0, prompts)  # stop before the engine
        pending = asyncio.ensure_future(server.completions({"model": "m", "prompt": "a long text"}))
        await asyncio.sleep(0.05)  # the loop runs while the tokenizer works
        tokenizer.release.set()
        return await pending

    assert asyncio.run(scenario()) == [[1, 2, 3]]


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
