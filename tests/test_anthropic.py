"""Anthropic's Messages API in-process on the scripted Kimi-K2 chat checkpoints of tests/k2_chat.py (the plain one and
the thinking one): text, tool use and tool results, thinking blocks, prefill, stop reasons and usage, whole and
streamed (the events a client assembles equal the whole Message), token counts, and a 400 in Anthropic's shape naming
the field for each request kdray cannot serve as asked."""
import asyncio
import json
import typing
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from k2_chat import ANSWER_TEXT, CALLS, GREETING, GREETING_TEXT, THOUGHT, THOUGHT_TEXT, make_k2_chat_checkpoint

from kdray import LLM
from kdray.serve.anthropic import AnthropicServing, MessagesRequest, _Reply, error_body
from kdray.serve.async_engine import AsyncEngine
from kdray.serve.metrics import Metrics
from kdray.serve.protocol import APIError, parse_json
from kdray.serve.serving import OpenAIServing

USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
TOOLS = [{"name": name, "description": f"The {name[4:]} of a place",
          "input_schema": {"type": "object", "properties": {k: {"type": "string"} for k in args}}}
         for name, args, _ in CALLS]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
DELTA_KEYS = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
TOOL_USES = [{"type": "tool_use", "id": call_id, "name": name, "input": args} for name, args, call_id in CALLS]


def _serving(path) -> AnthropicServing:
    llm = LLM(model=str(path), spec="ar", device="cpu")
    return AnthropicServing(OpenAIServing(AsyncEngine(llm.engine, max_num_seqs=4, max_queue=4, metrics=Metrics()),
                                          "k2"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    serving = _serving(make_k2_chat_checkpoint(tmp_path_factory.mktemp("m") / "k2-chat"))
    yield serving
    serving.openai.engine.shutdown()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    serving = _serving(make_k2_chat_checkpoint(tmp_path_factory.mktemp("m") / "k2-thinking", thinking=True))
    yield serving
    serving.openai.engine.shutdown()


def events(serving: AnthropicServing, body: dict) -> list[dict]:
    """The streamed events' data, each checked to name its own type."""
    async def go():
        return [e async for e in await serving.messages({"model": "k2", "max_tokens": 64, "messages": USER, **body,
                                                         "stream": True})]

    out = []
    for sent in asyncio.run(asyncio.wait_for(go(), 120)):
        name, data = sent.removesuffix("\n\n").split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {out[-1]['type']}"
    return out


def message(serving: AnthropicServing, body: dict) -> dict:
    return asyncio.run(asyncio.wait_for(serving.messages({"model": "k2", "max_tokens": 64, "messages": USER, **body}),
                                        120))


def assembled(stream: list[dict]) -> dict:
    """The Message a client assembles from streamed events (as the SDK's accumulator does), checking their order:
    one message_start first, each block started, added to and stopped in turn, message_delta, message_stop last."""
    assert stream[0]["type"] == "message_start" and stream[-1]["type"] == "message_stop"
    msg, open_block = stream[0]["message"], None
    for e in stream[1:-1]:
        if e["type"] == "content_block_start":
            assert open_block is None and e["index"] == len(msg["content"])
            msg["content"].append(e["content_block"])
            open_block = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_block
            block, delta = msg["content"][open_block], e["delta"]
            key = DELTA_KEYS[delta["type"]]
            block[key] = block.get(key, "") + delta[key]
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_block
            block = msg["content"][open_block]
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("partial_json", "{}"))
            open_block = None
        else:
            assert e["type"] == "message_delta" and open_block is None
            msg |= e["delta"]
            msg["usage"] |= e["usage"]
    return msg


def prompt_tokens(msg: dict) -> int:
    """The prompt's tokens: those read anew and those the prefix cache held."""
    return msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"]


def both(serving: AnthropicServing, body: dict) -> dict:
    """The whole Message, checked equal (its id aside) to the one its stream makes."""
    whole, streamed = message(serving, body), assembled(events(serving, body))
    assert prompt_tokens(streamed) == prompt_tokens(whole)
    assert streamed["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    uncached = lambda m: {k: v for k, v in m.items() if k not in ("id", "usage")}  # noqa: E731
    assert uncached(streamed) == uncached(whole)
    return whole


def test_a_reply_as_a_message_whole_and_streamed(plain):
    msg = both(plain, {})
    prompt = plain.openai.tokenizer.encode(plain.openai.tokenizer.apply_chat_template(USER))
    assert msg["id"].startswith("msg_") and (msg["type"], msg["role"], msg["model"]) == ("message", "assistant", "k2")
    assert msg["content"] == [{"type": "text", "text": GREETING_TEXT}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("end_turn", None)
    assert msg["usage"] == {"input_tokens": len(prompt), "output_tokens": len(GREETING),
                            "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    assert asyncio.run(plain.count_tokens({"model": "k2", "messages": USER})) == {"input_tokens": len(prompt)}


def test_stop_sequences_and_max_tokens_end_the_reply(plain):
    msg = both(plain, {"stop_sequences": [" served"]})
    assert msg["content"] == [{"type": "text", "text": "".join(GREETING[:2])}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", " served")
    msg = both(plain, {"max_tokens": 2})
    assert msg["content"] == [{"type": "text", "text": "".join(GREETING[:2])}] and msg["stop_reason"] == "max_tokens"


def test_tool_use_whole_streamed_and_answered(plain):
    msg = both(plain, {"tools": TOOLS})
    assert msg["content"] == TOOL_USES and msg["stop_reason"] == "tool_use"
    one = both(plain, {"tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert one["content"] == TOOL_USES[:1] and one["stop_reason"] == "tool_use"
    results = [{"type": "tool_result", "tool_use_id": TOOL_USES[0]["id"], "content": "12°C, raining"},
               {"type": "tool_result", "tool_use_id": TOOL_USES[1]["id"], "is_error": False,
                "content": [{"type": "text", "text": "14:05"}]}]
    answer = both(plain, {"tools": TOOLS, "messages": [*USER, {"role": "assistant", "content": TOOL_USES},
                                                       {"role": "user", "content": results}]})
    assert answer["content"] == [{"type": "text", "text": ANSWER_TEXT}] and answer["stop_reason"] == "end_turn"


def test_what_reaches_the_chat_template(plain):
    """The system prompt, the assistant's tool uses, tool results (an error marked) and the user's text after them, as
    /tokenize renders the equal chat request; and a final assistant message continued (prefill)."""
    openai = plain.openai
    results = [{"type": "tool_result", "tool_use_id": TOOL_USES[0]["id"], "content": "no such city", "is_error": True},
               {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}}]
    body = {"model": "k2", "system": [{"type": "text", "text": "Be brief."}], "tools": TOOLS,
            "messages": [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                                  TOOL_USES[0]]},
                         {"role": "user", "content": results}]}
    chat = {"model": "k2", "tools": [{"type": "function", "function": {"name": t["name"], "description":
                                                                       t["description"], "parameters":
                                                                       t["input_schema"]}} for t in TOOLS],
            "messages": [{"role": "system", "content": "Be brief."}, *USER,
                         {"role": "assistant", "content": "Checking.", "tool_calls": [{
                             "id": TOOL_USES[0]["id"], "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                         {"role": "tool", "tool_call_id": TOOL_USES[0]["id"], "content": "Error: no such city"},
                         {"role": "user", "content": "Thanks."}]}
    tokens = asyncio.run(openai.tokenize(chat))["tokens"]
    assert "Error: no such city" in openai.tokenizer.decode(tokens)
    assert asyncio.run(plain.count_tokens(body)) == {"input_tokens": len(tokens)}

    prefill = [*USER, {"role": "assistant", "content": "It is"}]  # continued, as the chat request that says so
    msg = both(plain, {"messages": prefill, "temperature": 0, "max_tokens": 4})
    chat = asyncio.run(openai.chat({"model": "k2", "messages": prefill, "add_generation_prompt": False,
                                    "continue_final_message": True, "temperature": 0, "max_tokens": 4}))
    assert msg["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}]
    assert prompt_tokens(msg) == chat["usage"]["prompt_tokens"]


def test_thinking_blocks_whole_and_streamed(thinking):
    msg = both(thinking, {})
    assert msg["content"] == [{"type": "thinking", "thinking": THOUGHT_TEXT, "signature": ""},
                              {"type": "text", "text": GREETING_TEXT}]
    tools = both(thinking, {"tools": TOOLS, "tool_choice": {"type": "any"}})
    assert tools["content"] == [{"type": "thinking", "thinking": THOUGHT_TEXT, "signature": ""}, *TOOL_USES]
    # thinking disabled: the prompt closes the thought, so the reply answers at once
    closed = both(thinking, {"thinking": {"type": "disabled"}})
    assert closed["content"] == [{"type": "text", "text": GREETING_TEXT}]
    assert closed["usage"]["output_tokens"] == len(GREETING)
    counted = asyncio.run(thinking.count_tokens({"model": "k2", "messages": USER, "thinking": {"type": "disabled"}}))
    assert counted["input_tokens"] == prompt_tokens(closed)
    # an assistant's thinking block reaches the template as its reasoning
    turn = [*USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Be kind.", "signature": "x"},
                                                     {"type": "text", "text": "Hi."}]}, USER[0]]
    chat = [*USER, {"role": "assistant", "content": "Hi.", "reasoning_content": "Be kind."}, USER[0]]
    counted = asyncio.run(thinking.count_tokens({"model": "k2", "messages": turn}))["input_tokens"]
    assert counted == asyncio.run(thinking.openai.tokenize({"messages": chat}))["count"]
    assert counted > asyncio.run(thinking.count_tokens({"model": "k2", "messages": [
        *USER, {"role": "assistant", "content": "Hi."}, USER[0]]}))["input_tokens"]


@pytest.mark.parametrize("body,field", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [TOOL_USES[0]]}]}, "messages[0].content[0].type"),
    ({"messages": [*USER, {"role": "assistant", "content": TOOL_USES}]}, "messages[1]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_news"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
     "tool_choice.disable_parallel_tool_use"),
    ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "thinking"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
     "system[0].cache_control.ttl"),
    ({"temperature": 1.5}, "temperature"),
    ({"thinking": {"type": "between_tools"}}, "thinking.type"),
    ({"thinking": {"type": "disabled", "display": "omitted"}}, "thinking.display"),
    ({"output_config": {"effort": "low"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}, "tools": TOOLS,
      "tool_choice": {"type": "any"}}, "output_config.format"),
    ({"cache_control": {"type": "ephemeral", "ttl": "5m"}}, "cache_control.ttl"),
    ({"service_tier": "auto"}, "service_tier"),
    ({"max_tokens": None}, "max_tokens"),
])
def test_what_kdray_cannot_serve_as_asked_is_a_400_naming_the_field(plain, body, field):
    with pytest.raises(APIError) as e:
        message(plain, body)
    assert e.value.status == 400 and e.value.message.startswith(f"{field}:"), e.value.message
    assert error_body(e.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": e.value.message}}


def test_thinking_adaptive_and_display(thinking):
    """``adaptive`` lets the thought run as the model does; ``display: omitted`` leaves it out of the reply (it is
    still generated: the output tokens count it), ``summarized`` shows it whole."""
    shown = [{"type": "thinking", "thinking": THOUGHT_TEXT, "signature": ""}, {"type": "text", "text": GREETING_TEXT}]
    assert both(thinking, {"thinking": {"type": "adaptive"}})["content"] == shown
    assert both(thinking, {"thinking": {"type": "adaptive", "display": "summarized"}})["content"] == shown
    omitted = both(thinking, {"thinking": {"type": "adaptive", "display": "omitted"}})
    assert omitted["content"] == shown[1:] and omitted["usage"]["output_tokens"] == 2 + len(THOUGHT) + len(GREETING)


def test_structured_output_holds_the_text_to_its_schema(plain, thinking):
    for serving in (plain, thinking):  # the thinking model's thought runs free before the JSON
        msg = both(serving, {"output_config": {"format": {"type": "json_schema", "schema": CITY}}, "max_tokens": 40,
                             "temperature": 0})
        assert json.loads(msg["content"][-1]["text"]) == {"city": "Paris"} and msg["stop_reason"] == "end_turn"
    closed = both(thinking, {"output_config": {"format": {"type": "json_schema", "schema": CITY}}, "max_tokens": 40,
                             "temperature": 0, "thinking": {"type": "disabled"}})
    assert [b["type"] for b in closed["content"]] == ["text"]


@pytest.mark.parametrize("budget", [1, 2])
def test_a_thought_past_its_budget_is_cut_and_the_reply_answers(thinking, budget):
    """The scripted thought has two tokens: a budget of one cuts it after the first and ``</think>`` follows (the
    continuation answers, as after a whole thought); a budget of two leaves it whole. With a forced tool call the
    continuation's grammar holds the calls alone."""
    thought = THOUGHT[:budget]
    msg = both(thinking, {"thinking": {"type": "enabled", "budget_tokens": budget}})
    assert msg["content"] == [{"type": "thinking", "thinking": "".join(thought), "signature": ""},
                              {"type": "text", "text": GREETING_TEXT}]
    assert msg["stop_reason"] == "end_turn" and msg["usage"]["output_tokens"] == 2 + budget + len(GREETING)
    tools = both(thinking, {"thinking": {"type": "enabled", "budget_tokens": budget}, "tools": TOOLS,
                            "tool_choice": {"type": "any"}})
    assert tools["content"] == [{"type": "thinking", "thinking": "".join(thought), "signature": ""}, *TOOL_USES]


def test_a_cut_thought_without_room_for_the_answer_ends_for_length(thinking):
    msg = both(thinking, {"thinking": {"type": "enabled", "budget_tokens": 1}, "max_tokens": 3})
    assert msg["content"] == [{"type": "thinking", "thinking": THOUGHT[0], "signature": ""}]
    assert (msg["stop_reason"], msg["usage"]["output_tokens"]) == ("max_tokens", 3)
    with pytest.raises(APIError, match="must be less than max_tokens") as e:
        message(thinking, {"thinking": {"type": "enabled", "budget_tokens": 3}, "max_tokens": 3})
    assert e.value.param == "thinking.budget_tokens"


def test_a_call_without_an_object_of_arguments_is_text_not_a_tool_use():
    """A call the model wrote with arguments that are no JSON object cannot be a tool_use block (its input is an
    object): the Message keeps it as text and ends its turn."""
    call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "[1"}}
    body = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [call]},
                         "finish_reason": "tool_calls", "stop_reason": None}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}}
    msg = _Reply(SimpleNamespace(model="k2"), "msg_1").message(body)
    assert msg["content"] == [{"type": "text", "text": "f [1"}] and msg["stop_reason"] == "end_turn"
    assert msg["usage"] == {"input_tokens": 1, "output_tokens": 3, "cache_read_input_tokens": 4,
                            "cache_creation_input_tokens": 0}


# ---- property-based: no Messages request can hurt the server ---------------------------------------------

EXTREME = [-(2**63), -1, 0, 2**31, 2**63, 10**100]
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=6), st.floats(allow_nan=False), st.sampled_from(EXTREME),
                 st.sampled_from(["\ud800", ""]), st.lists(st.integers(-2, 2), max_size=2),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)}),
    st.fixed_dictionaries({"type": st.sampled_from(["tool_use", "tool_result", "thinking", "image", "document"])},
                          optional={"id": st.text(max_size=4), "tool_use_id": st.text(max_size=4),
                                    "name": st.text(max_size=4), "input": st.one_of(st.just({}), JUNK),
                                    "thinking": st.text(max_size=8), "content": st.one_of(st.text(max_size=8), JUNK)}),
    JUNK)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), JUNK),
                                 "content": st.one_of(st.text(max_size=12), st.lists(BLOCK, max_size=3), JUNK)})
FIELDS = {
    "max_tokens": st.one_of(st.integers(1, 3), st.sampled_from(EXTREME), JUNK),
    "temperature": st.one_of(st.floats(0, 1.5), JUNK), "top_p": st.one_of(st.floats(0, 1), JUNK),
    "top_k": st.one_of(st.integers(-1, 5), st.sampled_from(EXTREME), JUNK), "stream": st.one_of(st.booleans(), JUNK),
    "stop_sequences": st.one_of(st.lists(st.text(max_size=3), max_size=3), JUNK),
    "system": st.one_of(st.text(max_size=12), st.lists(BLOCK, max_size=2), JUNK),
    "tools": st.one_of(st.just(TOOLS), st.lists(st.fixed_dictionaries({"name": st.text(max_size=4),
                                                                         "input_schema": st.one_of(st.just({}), JUNK),
                                                                         "type": st.sampled_from(["custom", "bash"])}),
                                                max_size=2), JUNK),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"]),
                                                    "name": st.sampled_from(["get_time", "nope"])}), JUNK),
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"]),
                                                 "budget_tokens": st.one_of(st.integers(0, 3), JUNK)}), JUNK),
    "metadata": st.one_of(st.fixed_dictionaries({"user_id": st.text(max_size=4)}), JUNK),
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), JUNK),
}


@st.composite
def fuzzed_messages(draw) -> tuple[bool, dict]:
    """(on the thinking model, a request body): a valid request with some fields replaced by odd or malformed
    values."""
    body = {"model": "k2", "max_tokens": 2, "messages": USER, "stream": draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        body[name] = draw(FIELDS[name])
    return draw(st.booleans()), body


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=fuzzed_messages())
def test_no_messages_request_hurts_the_server(plain, thinking, case):
    """Each is a Message, a stream without an error event, or a 400 in Anthropic's shape; a normal request after it
    is served."""
    on_thinking, body = case
    serving = thinking if on_thinking else plain

    async def answer():
        try:
            reply = await serving.messages(parse_json(json.dumps(body).encode()))
        except APIError as e:
            return e
        return reply if isinstance(reply, dict) else [e async for e in reply]

    got = asyncio.run(asyncio.wait_for(answer(), 120))
    if isinstance(got, APIError):
        event(f"400: {got.message.split(':')[0]}")
        assert got.status == 400 and error_body(got)["error"]["type"] == "invalid_request_error", got.message
    elif isinstance(got, list):
        event("streamed")
        assert got[-1].startswith("event: message_stop") and not any(e.startswith("event: error") for e in got)
    else:
        event("message")
        assert got["type"] == "message" and got["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence",
                                                                   "tool_use")
    assert message(serving, {"max_tokens": 1})["usage"]["output_tokens"] == 1


# ---- every field has an effect or answers 400 naming it -----------------------------------------------------------

def _sampling(field: str, value) -> tuple:
    """A sampling field's effect: the engine request's parameters carry it (tests/test_serving_sampling.py shows
    what each does to the tokens)."""
    return "sampled", {field: value}, lambda params: getattr(params, field) == value


def _differs(key):
    return lambda a, b: key(a) != key(b)


FIELD_EFFECTS = {  # (kind, the field's value(s), how its effect shows against the base request's answer)
    "model": ("refused", {"model": "other"}),
    "max_tokens": ("changes", {"max_tokens": 2}, lambda a, b: b["usage"]["output_tokens"] == 2 != a["usage"][
        "output_tokens"]),
    "messages": ("changes", {"messages": [{"role": "user", "content": "Hi there"}]}, _differs(prompt_tokens)),
    "system": ("changes", {"system": "Be brief."}, _differs(prompt_tokens)),
    "stop_sequences": ("changes", {"stop_sequences": [" served"]}, lambda a, b: b["stop_reason"] == "stop_sequence"),
    "stream": ("changes", {"stream": True}, lambda a, b: isinstance(b, list) and assembled(b)["content"] ==
               a["content"]),
    "temperature": _sampling("temperature", 0.0), "top_p": _sampling("top_p", 0.5), "top_k": _sampling("top_k", 3),
    "tools": ("changes", {"tools": TOOLS}, lambda a, b: b["content"] == TOOL_USES),
    "tool_choice": ("changes", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}},
                    lambda a, b: b["content"] == TOOL_USES[1:]),
    "output_config": ("changes", {"output_config": {"format": {"type": "json_schema", "schema": CITY}}},
                      lambda a, b: json.loads(b["content"][0]["text"]) == {"city": "Paris"}),
    # this model does not think: a budget is refused (test_thinking_* above show thinking on one that does)
    "thinking": ("refused", {"thinking": {"type": "enabled", "budget_tokens": 8}}),
    # met by the prefix cache, which keeps every prompt's prefix anyway: the reply is the one without it
    "cache_control": ("changes", {"cache_control": {"type": "ephemeral"}}, lambda a, b: b["content"] == a["content"]),
    "metadata": ("bookkeeping", {"metadata": {"user_id": "u-1"}}),
    **{name: ("refused", {name: value}) for name, value in {
        "container": "c", "diagnostics": {"cache_miss_reason": True}, "inference_geo": "us", "service_tier": "auto",
        "speed": "fast", "user_profile_id": "p", "workspace_id": "w"}.items()},
}


def test_every_field_is_classified():
    from anthropic.types import message_create_params

    sdk = set(typing.get_type_hints(message_create_params.MessageCreateParamsStreaming))
    assert set(FIELD_EFFECTS) == sdk | set(MessagesRequest.model_fields)


@pytest.mark.parametrize("name", sorted(FIELD_EFFECTS))
def test_a_field_has_an_effect_or_answers_400_naming_it(plain, name):
    kind, fields, *check = FIELD_EFFECTS[name]
    base = {"max_tokens": 64, "temperature": 0}
    if kind == "refused":
        with pytest.raises(APIError) as e:
            message(plain, {**base, **fields})
        assert e.value.status == 400 and e.value.param.split(".")[0] == name, e.value.message
    elif kind == "sampled":
        sent = []
        generate = plain.openai.engine.generate

        async def spy(requests):
            sent.extend(params for _, _, params in requests)
            return await generate(requests)

        plain.openai.engine.generate = spy
        try:
            message(plain, fields)
        finally:
            del plain.openai.engine.generate
        assert check[0](sent[0])
    else:
        before = {**base, **{k: v for k, v in fields.items() if k == "tools"}}
        a = message(plain, before)
        if "stream" in fields:
            b = events(plain, before)
        else:
            b = message(plain, {**base, **fields})
        if kind == "changes":
            assert check[0](a, b), (a, b)
        else:
            assert b["content"] == a["content"]
