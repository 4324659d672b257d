"""A thinking model's reasoning apart from its reply (``reasoning_content``), through the OpenAI chat handler
in-process on the thinking variant of tests/k2_chat.py (K2-Thinking's markers and a template that writes them):
whole and streamed, after a thought the prompt opened, with tools, under a grammar (which holds the content only),
left out on request, cut at a budget of tokens; and where the reasoning ends, found as a reply grows."""
import asyncio
import json
import random

import pytest
from k2_chat import GREETING_TEXT, THOUGHT, THOUGHT_TEXT, TOOLS, make_k2_chat_checkpoint, token_ids

from kdray import LLM
from kdray.serve.async_engine import AsyncEngine
from kdray.serve.metrics import Metrics
from kdray.serve.protocol import APIError
from kdray.serve.reasoning import THINK, THINK_END, ReasoningFormat, ReasoningSplit
from kdray.serve.serving import OpenAIServing
from kdray.serve.tool_calls import K2_SECTION
from kdray.spec.structured_outputs import StructuredOutputsParams

IDS = token_ids()
USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}


def _serving(path) -> OpenAIServing:
    llm = LLM(model=str(path), spec="ar", device="cpu")
    return OpenAIServing(AsyncEngine(llm.engine, max_num_seqs=4, max_queue=4, metrics=Metrics()), "k2")


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    serving = _serving(make_k2_chat_checkpoint(tmp_path_factory.mktemp("m") / "k2-thinking", thinking=True))
    yield serving
    serving.engine.shutdown()


def call(serving: OpenAIServing, body: dict):
    """The response body, or the streamed chunks' objects."""
    async def go():
        answer = await serving.chat({"model": "k2", "messages": USER, **body})
        if isinstance(answer, dict):
            return answer
        return [json.loads(e[6:]) for e in [e async for e in answer] if e != "data: [DONE]\n\n"]

    return asyncio.run(asyncio.wait_for(go(), 120))


def streamed(chunks: list[dict]) -> dict:
    """The message a client assembles from streamed deltas (reasoning_content only when some was sent)."""
    message = {"content": ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            if "reasoning_content" in delta:
                message["reasoning_content"] = message.get("reasoning_content", "") + delta["reasoning_content"]
    return message


@pytest.mark.parametrize("kwargs", [{}, {"open_thought": True}], ids=["model-opens", "prompt-opens"])
def test_the_reasoning_comes_apart_from_the_content_whole_and_streamed(thinking, kwargs):
    body = {"chat_template_kwargs": kwargs, "seed": 3}
    r = call(thinking, body)
    message = r["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT_TEXT, GREETING_TEXT)
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(THOUGHT)}
    chunks = call(thinking, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed(chunks) == {"reasoning_content": THOUGHT_TEXT, "content": GREETING_TEXT}
    uncached = lambda usage: {k: v for k, v in usage.items() if k != "prompt_tokens_details"}  # noqa: E731
    assert uncached(chunks[-1]["usage"]) == uncached(r["usage"])  # the stream's prompt is cached


def test_a_reply_that_does_not_think_has_no_reasoning(thinking):
    r = call(thinking, {"chat_template_kwargs": {"thinking": False}})  # the template closes an empty thought
    assert r["choices"][0]["message"] == {"role": "assistant", "content": GREETING_TEXT}
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_include_reasoning_false_leaves_the_reasoning_out(thinking):
    r = call(thinking, {"include_reasoning": False})
    assert r["choices"][0]["message"] == {"role": "assistant", "content": GREETING_TEXT}
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(THOUGHT)}
    assert streamed(call(thinking, {"include_reasoning": False, "stream": True})) == {"content": GREETING_TEXT}


def test_tool_calls_after_a_thought(thinking):
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required"}):
        message = call(thinking, body)["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (THOUGHT_TEXT, None)
        assert [t["function"]["name"] for t in message["tool_calls"]] == ["get_weather", "get_time"]


@pytest.mark.parametrize("kwargs", [{}, {"open_thought": True}], ids=["model-opens", "prompt-opens"])
def test_a_grammar_holds_the_content_after_a_free_thought(thinking, kwargs):
    """Held from the first token, the reply could not think (and with the thought opened by the prompt, its JSON
    would be reasoning): the grammar starts after the thought."""
    body = {"chat_template_kwargs": kwargs, "seed": 5, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}}
    for r in (call(thinking, body), call(thinking, {**body, "stream": True})):
        message = r["choices"][0]["message"] if isinstance(r, dict) else streamed(r)
        assert message["reasoning_content"] == THOUGHT_TEXT
        assert json.loads(message["content"]) == {"city": "Paris"}


def test_a_stop_string_in_the_thought_ends_the_reply_there(thinking):
    r = call(thinking, {"stop": [" A greeting"]})
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "", "reasoning_content": THOUGHT[0]}
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_reasoning_held_back_for_a_stop_string_comes_out_whole(thinking, stream):
    """A stop string right after the thought: the thought's last characters, held back while they could begin it,
    reach the reasoning when the reply ends (a stream's reasoning was cut where it stood at ``</think>``)."""
    r = call(thinking, {"stop": ["Hello"], "stream": stream})
    message = streamed(r) if stream else r["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT_TEXT, "")


def test_an_assistant_messages_reasoning_reaches_a_template_that_reads_it(thinking, tmp_path):
    turn = [*USER, {"role": "assistant", "content": "Hi.", "reasoning_content": "Be kind."}, USER[0]]
    plain = [*USER, {"role": "assistant", "content": "Hi."}, USER[0]]
    text = thinking.tokenizer.apply_chat_template(turn)
    assert "<think>Be kind.</think>Hi." in text
    with_reasoning = call(thinking, {"messages": turn, "max_tokens": 1})["usage"]["prompt_tokens"]
    assert with_reasoning > call(thinking, {"messages": plain, "max_tokens": 1})["usage"]["prompt_tokens"]
    renamed = [*USER, {"role": "assistant", "content": "Hi.", "reasoning": "Be kind."}, USER[0]]  # vLLM's newer name
    assert call(thinking, {"messages": renamed, "max_tokens": 1})["usage"]["prompt_tokens"] == with_reasoning

    other = _serving(make_k2_chat_checkpoint(tmp_path / "k2-chat"))  # K2-Instruct's way: no <think> anywhere
    try:
        assert other.reasoning is None
        with pytest.raises(APIError, match="does not read it") as e:
            call(other, {"messages": turn})
        assert e.value.param == "messages[1].reasoning_content"
        for field, value in (("include_reasoning", False), ("thinking_token_budget", 8)):
            with pytest.raises(APIError, match="does not think") as e:
                call(other, {field: value})
            assert e.value.param == field
    finally:
        other.engine.shutdown()
    with pytest.raises(APIError, match="only assistant messages carry reasoning_content"):
        call(thinking, {"messages": [{**USER[0], "reasoning_content": "x"}]})


@pytest.mark.parametrize("kwargs", [{}, {"open_thought": True}], ids=["model-opens", "prompt-opens"])
def test_thinking_token_budget_cuts_the_thought_and_the_reply_answers(thinking, kwargs):
    """vLLM's ``thinking_token_budget``: the scripted thought (two tokens) cut after one, or closed in the prompt
    (0); the reply answers after it, whole and streamed; under a grammar the answer follows it."""
    for budget, reasoning in ((1, THOUGHT[0]), (2, THOUGHT_TEXT), (0, None)):
        body = {"chat_template_kwargs": kwargs, "thinking_token_budget": budget}
        message = call(thinking, body)["choices"][0]["message"]
        assert (message.get("reasoning_content"), message["content"]) == (reasoning, GREETING_TEXT), budget
        got = streamed(call(thinking, {**body, "stream": True}))
        assert (got.get("reasoning_content"), got["content"]) == (reasoning, GREETING_TEXT), budget
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for budget, reasoning in ((1, THOUGHT[0]), (0, None)):
        message = call(thinking, {"chat_template_kwargs": kwargs, "thinking_token_budget": budget, "max_tokens": 40,
                                  "response_format": schema})["choices"][0]["message"]
        assert message.get("reasoning_content") == reasoning and json.loads(message["content"]) == {"city": "Paris"}


@pytest.mark.parametrize("field,value", [("n", 2), ("logprobs", True), ("min_tokens", 1)])
def test_thinking_token_budget_is_for_one_sample_without_logprobs_or_min_tokens(thinking, field, value):
    with pytest.raises(APIError, match=f"leave out {field} or the budget") as e:
        call(thinking, {"thinking_token_budget": 4, field: value})
    assert e.value.param == "thinking_token_budget"


def test_a_thought_opened_by_the_prompt_is_its_last_marker():
    fmt = ReasoningFormat(None, IDS[THINK], IDS[THINK_END], IDS[K2_SECTION])
    assert fmt.opened([5, IDS[THINK]]) and fmt.opened([IDS[THINK_END], 5, IDS[THINK], 6])
    assert not fmt.opened([5, 6]) and not fmt.opened([IDS[THINK], IDS[THINK_END], 7])


def _split_of(fmt: ReasoningFormat, ids: list[int], opened: bool) -> tuple:
    """The reference: (start, end, content), start None when the reply does not think."""
    if not opened and (not ids or ids[0] != fmt.think):
        return None, None, 0
    start = 0 if opened else 1
    for i in range(start, len(ids)):
        if ids[i] in (fmt.think_end, fmt.section):
            return start, i, i + (ids[i] == fmt.think_end)
    return start, None, None


def test_the_split_found_as_a_reply_grows_is_the_split_of_the_whole_reply():
    fmt = ReasoningFormat(None, IDS[THINK], IDS[THINK_END], IDS[K2_SECTION])  # the split reads ids only
    rng = random.Random(0)
    pool = [fmt.think, fmt.think_end, fmt.section, 300, 301, 302, 303, 304]
    for _ in range(500):
        ids, opened = [rng.choice(pool) for _ in range(rng.randint(0, 12))], rng.random() < 0.5
        split, fed = ReasoningSplit(fmt, opened), 0
        while fed < len(ids):
            fed = min(len(ids), fed + rng.randint(1, 4))
            split.feed(ids[:fed])
        start, end, content = _split_of(fmt, ids, opened)
        assert (split.start, split.end, split.content) == (start, end, content), (ids, opened)
        assert split.tokens == (0 if start is None else (len(ids) if end is None else end) - start)


def test_the_grammar_after_a_thought_lets_the_thought_run_free_then_holds_the_rest(thinking):
    tokenizer, fmt, grammars = thinking.tokenizer, thinking.reasoning, thinking.engine.engine.grammars
    text = [IDS[t] for t in THOUGHT]
    json_ids = tokenizer.encode('{"city": "Paris"}')
    eos = grammars.eos_ids[0]
    params = StructuredOutputsParams(json=CITY)

    def accepts(opened: bool, ids: list[int]) -> bool:
        state = grammars.start(fmt.grammar(params, opened))
        return all(state.matcher.accept_token(i) for i in ids)

    assert accepts(False, [fmt.think, *text, fmt.think_end, *json_ids, eos])
    assert accepts(False, [*json_ids, eos])  # no thought at all
    assert not accepts(False, [fmt.think, *text, eos])  # the reply cannot end inside the thought
    assert not accepts(False, [fmt.think, *text, fmt.think_end, *text])  # the rest is JSON
    assert not accepts(False, [fmt.think, fmt.section])  # a tool-call section waits for the thought's end
    assert accepts(True, [*text, fmt.think_end, *json_ids, eos])
    assert not accepts(True, [fmt.think])  # a thought the prompt opened is not opened again
    assert not accepts(True, [*json_ids, eos])  # ... and is closed first
