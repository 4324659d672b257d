"""OpenAI request handling without a server: how many tokens a request may generate."""
from types import SimpleNamespace

import pytest

from kdray.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kdray.serve.serving import DEFAULT_COMPLETION_TOKENS, OpenAIServing

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
