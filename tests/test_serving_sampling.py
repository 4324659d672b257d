"""The sampling fields that change the target's distribution, and log-probabilities, through the OpenAI handlers
in-process (the K2-layout chat checkpoint of tests/k2_chat.py on an AR engine): each field's bounds answer a 400
naming it, and logprobs come in OpenAI's shapes, streamed and not, equal to the engine's (with echo, the prompt's
first)."""
import asyncio
import json
import math

import pytest
from k2_chat import GREETING, make_k2_chat_checkpoint, token_ids

from kdray import LLM, SamplingParams
from kdray.engine.request import RequestOutput, join_output
from kdray.serve.async_engine import AsyncEngine
from kdray.serve.metrics import Metrics
from kdray.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, validate
from kdray.serve.serving import OpenAIServing

PROMPT = "<|im_assistant|>assistant<|im_middle|>"  # the scripted greeting follows
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    llm = LLM(model=str(make_k2_chat_checkpoint(tmp_path_factory.mktemp("m") / "k2-chat")), spec="ar", device="cpu")
    engine = AsyncEngine(llm.engine, max_num_seqs=4, max_queue=4, metrics=Metrics())
    yield OpenAIServing(engine, "k2-chat")
    engine.shutdown()


def call(serving: OpenAIServing, route: str, body: dict):
    """The response body, or the streamed chunks' objects."""
    async def go():
        answer = await (serving.chat if route == "chat" else serving.completions)({"model": "k2-chat", **body})
        if isinstance(answer, dict):
            return answer
        return [json.loads(e[6:]) for e in [e async for e in answer] if e != "data: [DONE]\n\n"]

    return asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize("model,fields,param,message", [
    (CompletionRequest, {"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    (CompletionRequest, {"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    (CompletionRequest, {"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    (CompletionRequest, {"repetition_penalty": 11}, "repetition_penalty", "less than or equal to 10"),
    (CompletionRequest, {"min_p": 1.5}, "min_p", "less than or equal to 1"),
    (CompletionRequest, {"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    (CompletionRequest, {"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
    (CompletionRequest, {"logit_bias": {"five": 1}}, "logit_bias", "token ids written as decimal strings"),
    (CompletionRequest, {"logit_bias": {"99999999": 1}}, "logit_bias", "token ids written as decimal strings"),
    (CompletionRequest, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 items"),
    (CompletionRequest, {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    (CompletionRequest, {"logprobs": True}, "logprobs", "valid integer"),
    (CompletionRequest, {"max_tokens": 0}, "max_tokens", "needs echo: true"),
    (CompletionRequest, {"max_tokens": -1, "echo": True}, "max_tokens", "greater than or equal to 0"),
    (ChatCompletionRequest, {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    (CompletionRequest, {"top_logprobs": 2}, "top_logprobs", "kdray does not implement this field"),
    (ChatCompletionRequest, {"logprobs": 2}, "logprobs", "valid boolean"),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    (ChatCompletionRequest, {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
])
def test_each_field_out_of_bounds_is_a_400_naming_it(model, fields, param, message):
    body = {"model": "m", "prompt": "x"} if model is CompletionRequest else {"model": "m", "messages": USER}
    with pytest.raises(APIError, match=message) as e:
        validate(model, {**body, **fields})
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize("fields,param", [({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
                                          ({"logit_bias": {"1024": 1}}, "logit_bias")])
def test_fields_checked_against_the_request_and_the_model_are_400s_naming_them(serving, fields, param):
    with pytest.raises(APIError) as e:
        call(serving, "completions", {"prompt": PROMPT, **fields})
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_min_tokens_outlasts_eos(serving):
    plain = call(serving, "completions", {"prompt": PROMPT, "max_tokens": 8})
    longer = call(serving, "completions", {"prompt": PROMPT, "max_tokens": 8, "min_tokens": 6})
    assert plain["usage"]["completion_tokens"] == len(GREETING) and plain["choices"][0]["finish_reason"] == "stop"
    assert longer["usage"]["completion_tokens"] >= 6
    assert longer["choices"][0]["text"].startswith(plain["choices"][0]["text"])


def engine_output(serving, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
    """The engine's own final output for the same request (its streamed outputs joined)."""
    whole = {}

    async def go():
        stream = await serving.engine.generate([("ref", prompt_ids, params)])
        async for out in stream:
            join_output(whole, out)

    asyncio.run(go())
    return whole["ref"]


def engine_logprobs(serving, prompt_ids: list[int], k: int) -> tuple[list[int], list[dict]]:
    """The engine's own tokens and log-probabilities for the same request."""
    out = engine_output(serving, prompt_ids, SamplingParams(max_tokens=4, logprobs=k, temperature=1.0, seed=3))
    assert serving.engine.engine.vocab_size == 1024
    c = out.outputs[0]
    assert math.isclose(c.cumulative_logprob, sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))
    return c.token_ids, c.logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_in_openais_shape(serving, stream):
    body = {"prompt": "x", "max_tokens": 4, "temperature": 1.0, "seed": 3, "logprobs": 3, "stream": stream,
            "return_token_ids": True}
    answer = call(serving, "completions", body)
    if stream:  # the chunks' logprobs, joined
        chunks = [c["choices"][0] for c in answer if c["choices"]]
        lp = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        ids = [t for c in chunks for t in c["token_ids"]]
    else:
        lp, ids = answer["choices"][0]["logprobs"], answer["choices"][0]["token_ids"]
    tok = serving.tokenizer
    ref_ids, ref = engine_logprobs(serving, tok.encode("x"), 3)
    assert ids == ref_ids and len(ids) == 4
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"] == pytest.approx([d[t].logprob for t, d in zip(ids, ref)])
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(4)]
    for top, t, d in zip(lp["top_logprobs"], ids, ref):  # the top 3 best first, and the emitted token
        best = sorted((lp.rank, u, lp.logprob) for u, lp in d.items() if lp.rank <= 3 or u == t)
        assert [r for r, _, _ in best[:3]] == [1, 2, 3]
        assert top == pytest.approx({tok.decode([u]): v for _, u, v in best})  # (texts may coincide: one key)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_in_openais_shape(serving, stream):
    body = {"messages": USER, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "stream": stream,
            "return_token_ids": True}  # the scripted greeting: each token the likeliest
    answer = call(serving, "chat", body)
    if stream:
        chunks = [c["choices"][0] for c in answer if c["choices"]]
        content = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
        ids = [t for c in chunks for t in c.get("token_ids", [])]
    else:
        content, ids = answer["choices"][0]["logprobs"]["content"], answer["choices"][0]["token_ids"]
    assert len(content) == len(ids) == 4
    tok = serving.tokenizer
    for entry, t in zip(content, ids):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == tok.decode([t]) and entry["bytes"] == list(entry["token"].encode())
        top = [e["logprob"] for e in entry["top_logprobs"]]
        assert len(top) == 2 and top == sorted(top, reverse=True) and entry["logprob"] == top[0]
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # the emitted token leads the top


def test_without_logprobs_the_field_is_null(serving):
    answer = call(serving, "chat", {"messages": USER, "max_tokens": 2})
    assert answer["choices"][0]["logprobs"] is None
    answer = call(serving, "completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 0})
    lp = answer["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 2 and all(len(top) == 1 for top in lp["top_logprobs"])  # the emitted token alone


def joined(chunks: list[dict]) -> dict:
    """The completions log-probabilities of streamed chunks, joined."""
    return {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_before_the_output(serving, stream):
    """OpenAI's legacy shape (vLLM's too): the prompt's tokens lead, the first with null log-probabilities, then the
    output's; the values are the engine's prompt_logprobs; streamed, the first chunk carries the prompt part."""
    body = {"prompt": "Paris" + PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
            "stream": stream}
    answer = call(serving, "completions", body)
    tok = serving.tokenizer
    prompt_ids = tok.encode(body["prompt"])
    ref = engine_output(serving, prompt_ids, SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2))
    if stream:
        chunks = [c["choices"][0] for c in answer if c["choices"]]
        assert chunks[0]["text"] == body["prompt"]
        assert chunks[0]["logprobs"]["tokens"] == [tok.decode([t]) for t in prompt_ids]
        lp, text = joined(chunks), "".join(c["text"] for c in chunks)
    else:
        lp, text = answer["choices"][0]["logprobs"], answer["choices"][0]["text"]
    c = ref.outputs[0]
    ids, found = prompt_ids + c.token_ids, ref.prompt_logprobs + c.logprobs
    assert len(prompt_ids) > 3 and len(c.token_ids) == 3 and text == body["prompt"] + c.text
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([d[t].logprob for t, d in zip(ids[1:], found[1:])])
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(len(ids))]
    for top, t, d in zip(lp["top_logprobs"][1:], ids[1:], found[1:]):  # the top 2, and the scored token
        assert top == pytest.approx({tok.decode([u]): x.logprob for u, x in d.items() if x.rank <= 2 or u == t})


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_answers_the_prompt_alone(serving, stream):
    body = {"prompt": "Paris" + PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "stream": stream,
            "return_token_ids": True, **({"stream_options": {"include_usage": True}} if stream else {})}
    answer = call(serving, "completions", body)
    if stream:
        chunks = [c["choices"][0] for c in answer if c["choices"]]
        lp, text, used = joined(chunks), "".join(c["text"] for c in chunks), answer[-1]["usage"]
        ids, finish = [t for c in chunks for t in c["token_ids"]], chunks[-1]["finish_reason"]
    else:
        choice, used = answer["choices"][0], answer["usage"]
        lp, text, ids, finish = choice["logprobs"], choice["text"], choice["token_ids"], choice["finish_reason"]
    prompt_ids = serving.tokenizer.encode(body["prompt"])
    assert (text, ids, finish, used["completion_tokens"]) == (body["prompt"], [], "length", 0)
    assert len(lp["tokens"]) == len(prompt_ids) == used["prompt_tokens"] and lp["token_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(serving):
    """A prompt's full pages are cached once it has run (but its last token's): the same prompt again reports them
    in ``usage.prompt_tokens_details.cached_tokens``, streamed too; n choices count their prompt once."""
    page = serving.engine.engine.scheduler.page_size
    messages = [{"role": "user", "content": "Paris weather report " * 12 + "please, in detail."}]  # a few pages
    first = call(serving, "chat", {"messages": messages, "max_tokens": 2})["usage"]
    again = call(serving, "chat", {"messages": messages, "max_tokens": 2})["usage"]
    held = (first["prompt_tokens"] - 1) // page * page
    assert held >= 2 * page and first["prompt_tokens_details"]["cached_tokens"] < held  # the template's head may be
    assert again["prompt_tokens_details"] == {"cached_tokens": held}
    chunks = call(serving, "chat", {"messages": messages, "max_tokens": 2, "stream": True,
                                    "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == again
    two = call(serving, "chat", {"messages": messages, "max_tokens": 2, "n": 2})["usage"]
    assert (two["prompt_tokens"], two["prompt_tokens_details"]) == (first["prompt_tokens"], {"cached_tokens": held})


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_names_the_stop_string_or_token_that_ended_the_reply(serving, stream):
    """vLLM's ``stop_reason``: the first stop string in the text (not the first listed), the stop token id, or null
    for EOS and max_tokens."""
    def ended(body: dict) -> tuple:
        answer = call(serving, "chat", {"messages": USER, "stream": stream, **body})
        choice = [c["choices"][0] for c in answer if c["choices"]][-1] if stream else answer["choices"][0]
        return choice["finish_reason"], choice["stop_reason"]

    assert ended({"stop": [" served", "tiny"]}) == ("stop", "tiny")
    assert ended({"stop_token_ids": [token_ids()[GREETING[1]]]}) == ("stop", token_ids()[GREETING[1]])
    assert ended({}) == ("stop", None)  # EOS
    assert ended({"max_tokens": 1}) == ("length", None)
