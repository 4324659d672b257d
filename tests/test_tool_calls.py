"""Tool calls parsed from chat replies (Kimi-K2's tool-call tokens, Hermes' JSON), whole and streamed: the deltas
of a reply cut into random chunks add up to the whole reply's message."""
import asyncio
import copy
import json
import random

import pytest
from test_tokenizer import write_k2_dir

from kdray.engine.request import CompletionOutput, RequestOutput
from kdray.model.tokenizer import IncrementalDetokenizer, TiktokenBackend, Tokenizer
from kdray.serve.protocol import ChatCompletionRequest
from kdray.serve.serving import OpenAIResponse
from kdray.serve.tool_calls import ToolCallParser

BYTES = {bytes([b]): b for b in range(256)}
TOOLS = [{"type": "function", "function": {"name": name}} for name in ("get_weather", "get_time")]
K2_REPLY = ("Let me check the weather in Zürich.<|tool_calls_section_begin|>"
            "<|tool_call_begin|> functions.get_weather:0 <|tool_call_argument_begin|> {\"city\": \"Zürich\"}\n"
            "<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_calls_section_end|>")
K2_CALLS = [("functions.get_weather:0", "get_weather", '{"city": "Zürich"}'),
            ("functions.get_time:1", "get_time", "{}")]
HERMES_REPLY = ("Sure <tool_ use.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n"
                "</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>")
HERMES_CALLS = [(None, "get_weather", '{"city": "Zürich"}'), (None, "get_time", "{}")]


@pytest.fixture(scope="module")
def k2(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_k2_dir(tmp_path_factory.mktemp("k2"), BYTES))


@pytest.fixture(scope="module")
def hermes() -> Tokenizer:
    return Tokenizer(TiktokenBackend(BYTES, {}))


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **fields)


def outputs(tok: Tokenizer, ids: list[int], rng: random.Random, finish: str = "stop") -> list[RequestOutput]:
    """The engine's streamed outputs of a reply arriving in chunks of 1-4 ids (each one's text and ids added)."""
    cuts, at = [0], 0
    while at < len(ids):
        at = min(len(ids), at + rng.randint(1, 4))
        cuts.append(at)
    detok, outs = IncrementalDetokenizer(tok), []
    for m, n in zip(cuts, cuts[1:]):
        end = n == len(ids)
        text = detok.add(ids[m:n]) + (detok.flush() if end else "")
        outs.append(RequestOutput("r-0", [1], [CompletionOutput(0, text, ids[m:n], finish if end else None)], end,
                                  {"generated_tokens": n}))
    return outs


def joined(outs: list[RequestOutput]) -> RequestOutput:
    """The whole output that streamed ``outs`` make (they stay as they are)."""
    whole = copy.deepcopy(outs[0])
    for out in outs[1:]:
        whole.add(out)
    return whole


class FakeStream:
    def __init__(self, outs):
        self.outs = iter(outs)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self.outs)
        except StopIteration:
            raise StopAsyncIteration from None

    def abort(self):
        pass


def streamed(response: OpenAIResponse, outs: list[RequestOutput]) -> dict:
    """The message a client assembles from the SSE deltas: content, tool calls, finish reason."""
    async def collect():
        return [event async for event in response.sse(FakeStream(outs), lambda: None)]

    content, calls, finish = "", [], None
    for event in asyncio.run(collect()):
        if event.startswith("data: {"):
            for choice in json.loads(event[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                for d in choice["delta"].get("tool_calls", []):
                    if d["index"] == len(calls):
                        calls.append({"id": d["id"], "type": d["type"], "function": {"name": d["function"]["name"],
                                                                                     "arguments": ""}})
                    calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
                finish = choice["finish_reason"] or finish
    return {"content": content or None, "tool_calls": calls, "finish_reason": finish}


class CountingTokenizer:
    """A tokenizer that counts the ids it decodes."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.backend, self.decoded = tok, tok.backend, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


def test_a_streamed_reply_is_decoded_as_it_grows_not_again_at_every_chunk(k2):
    """A stream decodes each new id's window (the tool-call text of a reply of n ids: O(n) ids decoded in all), not
    the whole reply at every chunk (O(n^2): a 32k-token reply decoded 32k times over)."""
    ids = k2.encode("Let me think about this for a while. " * 60 + K2_REPLY)
    counting = CountingTokenizer(k2)
    got = streamed(OpenAIResponse("r", "m", True, chat_request(), 1, 1, tools=ToolCallParser(counting)),
                   outputs(k2, ids, random.Random(0)))
    check_calls(got["tool_calls"], K2_CALLS)
    assert got["content"].startswith("Let me think") and len(ids) > 400
    assert counting.decoded < 30 * len(ids), f"{counting.decoded} ids decoded for a reply of {len(ids)}"


def check_calls(calls: list[dict], expected: list[tuple]):
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [e[1:] for e in expected]
    for call, (call_id, _, _) in zip(calls, expected):
        assert call["id"] == call_id if call_id else call["id"].startswith("call_")


@pytest.mark.parametrize("fmt", ["k2", "hermes"])
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_calls_whole_and_streamed_in_random_chunks(request, fmt, parallel):
    tok = request.getfixturevalue(fmt)
    reply, expected = (K2_REPLY, K2_CALLS) if fmt == "k2" else (HERMES_REPLY, HERMES_CALLS)
    expected = expected if parallel else expected[:1]
    content = reply[:reply.index("<|tool_calls" if fmt == "k2" else "<tool_call>")]
    parser = ToolCallParser(tok)
    assert parser.k2 == (fmt == "k2")
    req = chat_request(parallel_tool_calls=parallel)
    ids = tok.encode(reply)
    rng = random.Random(0)
    for _ in range(20):
        outs = outputs(tok, ids, rng)
        body = OpenAIResponse("r", "m", True, req, 1, 1, tools=parser).body([joined(outs)])
        message, finish = body["choices"][0]["message"], body["choices"][0]["finish_reason"]
        assert (message["content"], finish) == (content, "tool_calls")
        check_calls(message["tool_calls"], expected)
        got = streamed(OpenAIResponse("r", "m", True, req, 1, 1, tools=parser), outs)
        assert got["content"] == content and got["finish_reason"] == "tool_calls"
        check_calls(got["tool_calls"], expected)


def test_replies_without_complete_calls_keep_their_text(k2, hermes):
    rng = random.Random(1)
    cases = [(k2, "Just text, no tools.", "stop"), (hermes, "Just text <tool", "stop"),
             (hermes, "Bad: <tool_call>{\"name\": \"get_weather\", \"arguments\": [1]}</tool_call>", "stop"),
             (k2, K2_REPLY[:K2_REPLY.index("<|tool_call_end|>")], "length"),  # cut inside the first call
             (k2, "Stray <|tool_call_end|> and <|tool_call_begin|>, no call.", "stop")]  # markers outside a section
    for tok, reply, finish in cases:
        ids = tok.encode(reply)
        outs = outputs(tok, ids, rng, finish)
        response = OpenAIResponse("r", "m", True, chat_request(), 1, 1, tools=ToolCallParser(tok))
        message = response.body([joined(outs)])["choices"][0]["message"]
        assert message == {"role": "assistant", "content": tok.decode(ids)}
        got = streamed(OpenAIResponse("r", "m", True, chat_request(), 1, 1, tools=ToolCallParser(tok)), outs)
        assert got["finish_reason"] == finish
        if finish == "stop":
            assert (got["content"], got["tool_calls"]) == (tok.decode(ids), [])
        else:  # a cut call's name and arguments so far were streamed as they came, and its text is not sent again
            assert got["content"] == reply[:reply.index("<|tool_calls")]
            assert [c["function"]["name"] for c in got["tool_calls"]] == ["get_weather"]

