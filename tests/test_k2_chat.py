"""A Kimi-K2-layout checkpoint (tiktoken.model, tokenizer_config.json, K2's chat template; tests/k2_chat.py) served
end to end on the CPU and driven through the ``openai`` client: chat, tool calls (whole, streamed, answered),
what the request asks of the template, vLLM's /tokenize, /detokenize and /version, and Anthropic's /v1/messages
through the ``anthropic`` client."""
import json
import time

import anthropic
import openai
import pytest
import requests
from k2_chat import ANSWER_TEXT, CALLS, GREETING_TEXT, TOOLS

import kdray

pytestmark = pytest.mark.slow  # the shared Serve instance

MODEL = "k2-chat"
USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def streamed(chunks) -> tuple[str, list[dict], str]:
    """The content, tool calls and finish reason a client assembles from streamed deltas."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index == len(calls):
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_chat(k2_chat):
    c = client(k2_chat)
    r = c.chat.completions.create(model=MODEL, messages=USER)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (GREETING_TEXT, "stop")
    assert r.choices[0].message.tool_calls is None
    assert streamed(c.chat.completions.create(model=MODEL, messages=USER, stream=True)) == (GREETING_TEXT, [], "stop")


def test_tool_calls_whole_streamed_and_answered(k2_chat):
    c = client(k2_chat)
    r = c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    expected = [{"id": call_id, "name": name, "arguments": args} for name, args, call_id in CALLS]
    assert [{"id": t.id, "name": t.function.name, "arguments": json.loads(t.function.arguments)}
            for t in message.tool_calls] == expected

    content, calls, finish = streamed(c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert [{**t, "arguments": json.loads(t["arguments"])} for t in calls] == expected

    one = c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, parallel_tool_calls=False)
    assert [t.function.name for t in one.choices[0].message.tool_calls] == ["get_weather"]
    unparsed = c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none")
    assert unparsed.choices[0].message.tool_calls is None and "get_weather" in unparsed.choices[0].message.content

    results = [{"role": "tool", "tool_call_id": t.id, "content": "12°C, rain" if i == 0 else "14:05"}
               for i, t in enumerate(message.tool_calls)]
    r = c.chat.completions.create(model=MODEL, messages=[*USER, message, *results], tools=TOOLS)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ANSWER_TEXT, "stop")

    # forced: after the tool results the model would answer; "required" makes it call again (a grammar holds it)
    forced = c.chat.completions.create(model=MODEL, messages=[*USER, message, *results], tools=TOOLS,
                                       tool_choice="required")
    assert forced.choices[0].finish_reason == "tool_calls" and forced.choices[0].message.content is None
    assert {t.function.name for t in forced.choices[0].message.tool_calls} <= {"get_weather", "get_time"}


def test_template_requests_that_cannot_be_rendered_are_400s(k2_chat):
    c = client(k2_chat)
    with pytest.raises(openai.BadRequestError, match="final message is from 'user'") as e:
        c.chat.completions.create(model=MODEL, messages=USER, extra_body={"continue_final_message": True,
                                                                          "add_generation_prompt": False})
    assert e.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError, match="tool_call_id") as e:
        c.chat.completions.create(model=MODEL, messages=[*USER, {"role": "tool", "content": "12°C"}])
    assert e.value.body["param"] == "messages[1].tool_call_id"


def test_tokenize_detokenize_and_version(k2_chat):
    prompt_tokens = client(k2_chat).chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                            max_tokens=1).usage.prompt_tokens
    chat = requests.post(f"{k2_chat}/tokenize", json={"model": MODEL, "messages": USER, "tools": TOOLS},
                         timeout=30).json()
    assert (chat["count"], len(chat["tokens"]), chat["max_model_len"]) == (prompt_tokens, prompt_tokens, 2048)
    text = requests.post(f"{k2_chat}/detokenize", json={"tokens": chat["tokens"]}, timeout=30).json()["prompt"]
    assert text.startswith("tool_declare# Tools\n[{") and text.endswith("the time?assistant")  # specials skipped

    plain = requests.post(f"{k2_chat}/tokenize", json={"prompt": "Hello, Paris!"}, timeout=30).json()
    assert requests.post(f"{k2_chat}/detokenize", json={"model": MODEL, "tokens": plain["tokens"]},
                         timeout=30).json() == {"prompt": "Hello, Paris!"}
    r = requests.post(f"{k2_chat}/detokenize", json={"tokens": [5000]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert requests.get(f"{k2_chat}/version", timeout=10).json() == {"version": kdray.__version__}


def test_anthropic_messages_through_the_official_client(k2_chat):
    """The ``anthropic`` client on /v1/messages: a reply, tool use streamed and answered, a token count, and a 400 in
    Anthropic's shape."""
    c = anthropic.Anthropic(base_url=k2_chat, api_key="none", max_retries=0, timeout=120)
    r = c.messages.create(model=MODEL, max_tokens=64, messages=USER)
    assert [(b.type, b.text) for b in r.content] == [("text", GREETING_TEXT)] and r.stop_reason == "end_turn"
    assert c.messages.count_tokens(model=MODEL, messages=USER).input_tokens == (r.usage.input_tokens +
                                                                                r.usage.cache_read_input_tokens)

    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    with c.messages.stream(model=MODEL, max_tokens=64, messages=USER, tools=tools) as stream:
        called = stream.get_final_message()
    assert called.stop_reason == "tool_use"
    assert [(b.type, b.id, b.name, b.input) for b in called.content] == [("tool_use", call_id, name, args)
                                                                         for name, args, call_id in CALLS]
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "12°C, rain" if i == 0 else "14:05"}
               for i, b in enumerate(called.content)]
    answer = c.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=[
        *USER, {"role": "assistant", "content": called.content}, {"role": "user", "content": results}])
    assert [b.text for b in answer.content] == [ANSWER_TEXT]

    with pytest.raises(anthropic.BadRequestError, match="image") as e:
        c.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": e.value.body["error"]["message"]}}


def test_a_batch_of_anthropic_messages(k2_chat):
    """A batch job's /v1/messages lines are answered as /v1/messages answers: a Message, or an Anthropic-shaped 400
    for the bad line alone."""
    c = client(k2_chat)
    bodies = {"greet": {"model": MODEL, "max_tokens": 64, "messages": USER},
              "image": {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": [
                  {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}}
    lines = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/messages", "body": body}) + "\n"
                    for cid, body in bodies.items())
    file = c.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
    batch = c.batches.create(input_file_id=file.id, endpoint="/v1/messages", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, "the batch did not finish"
        time.sleep(0.1)
        batch = c.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 1
    out = {json.loads(line)["custom_id"]: json.loads(line)["response"]
           for line in c.files.content(batch.output_file_id).text.splitlines()}
    assert out["greet"]["status_code"] == 200
    assert out["greet"]["body"]["content"] == [{"type": "text", "text": GREETING_TEXT}]
    assert out["image"]["status_code"] == 400
    assert out["image"]["body"]["error"]["type"] == "invalid_request_error" and out["image"]["body"]["type"] == "error"
