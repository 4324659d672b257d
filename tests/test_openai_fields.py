"""Strict by default: each field of the ``openai`` package's request types, and each field kdray's request models
take, either has an effect (shown here on the K2-layout chat checkpoint of tests/k2_chat.py) or answers 400
naming it. The metadata fields (``user``, ...) are the one exception: accepted, for the client's own bookkeeping."""
import functools
import json
import typing

import pytest
import requests
from k2_chat import END, GREETING, TOOLS, token_ids
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from kdray.serve.protocol import METADATA_FIELDS, ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.slow  # the shared Serve instance

MODEL = "k2-chat"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREETING_START = "".join(GREETING[:2])  # the greeting up to " served by kdray."
# Base requests a field is added to: the scripted greeting, a uniform draw (after a token outside the script), tools
BASES = {
    "/v1/completions": {"model": MODEL, "prompt": "<|im_assistant|>assistant<|im_middle|>", "max_tokens": 8},
    "/v1/completions random": {"model": MODEL, "prompt": "x", "max_tokens": 4, "seed": 1, "return_token_ids": True},
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 8},
    "/v1/chat/completions random": {"model": MODEL, "messages": [*USER, {"role": "assistant", "content": "x"}],
                                    "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 4,
                                    "seed": 1, "return_token_ids": True},
    "/v1/chat/completions tools": {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 20},
}


def texts(r: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"] for c in r["choices"]]


def calls(r: dict) -> list[str]:
    return [t["function"]["name"] for t in r["choices"][0]["message"].get("tool_calls", [])]


def prompt_tokens_differ(a, b):
    return a["usage"]["prompt_tokens"] != b["usage"]["prompt_tokens"]


def tokens_differ(a, b):
    return [c["token_ids"] for c in a["choices"]] != [c["token_ids"] for c in b["choices"]]


def refused(value):
    """kdray does not honour it: a 400 naming the field."""
    return "refused", value


def metadata(value):
    """The client's bookkeeping: accepted, no effect on what is generated."""
    return "metadata", value


def changes(value, effect, base: str = "", **extra):
    """Added (with ``extra``) to the base request, the answer changes: ``effect(before, after)`` holds."""
    return "changes", value, effect, base, extra


IDS = token_ids()
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
GENERATION = {  # both routes
    "max_tokens": changes(2, lambda a, b: b["usage"]["completion_tokens"] == 2),
    "model": changes("gpt-4", lambda a, b: b["error"]["param"] == "model"),
    "n": changes(2, lambda a, b: len(b["choices"]) == 2),
    "seed": changes(2, tokens_differ, "random"),
    "temperature": changes(0, tokens_differ, "random"),
    "top_p": changes(0.01, tokens_differ, "random"),
    "top_k": changes(1, tokens_differ, "random"),
    "stop": changes([" served"], lambda a, b: texts(b) == [GREETING_START]),
    "stop_token_ids": changes([IDS[GREETING[1]]], lambda a, b: texts(b) == [GREETING_START], ignore_eos=True),
    "include_stop_str_in_output": changes(True, lambda a, b: texts(b) == [GREETING_START + " served"],
                                          stop=[" served"]),
    "ignore_eos": changes(True, lambda a, b: b["usage"]["completion_tokens"] == 8 > a["usage"]["completion_tokens"]),
    "stream": changes(True, lambda a, b: b.startswith("data: ") and b.endswith("data: [DONE]\n\n")),
    "stream_options": refused({"include_usage": True}),  # without stream (as vLLM)
    "return_token_ids": changes(True, lambda a, b: b["choices"][0]["token_ids"][-1] == IDS[END]),
    # a bias makes the uniform draw favour token 300; the penalties then move it off the token once drawn
    "logit_bias": changes({"300": 100}, lambda a, b: b["choices"][0]["token_ids"] == [300] * 4, "random"),
    "frequency_penalty": changes(2, tokens_differ, "random", logit_bias={"300": 8}),
    "presence_penalty": changes(2, tokens_differ, "random", logit_bias={"300": 8}),
    "repetition_penalty": changes(10, tokens_differ, "random", logit_bias={"300": 8}),
    "min_p": changes(0.5, lambda a, b: b["choices"][0]["token_ids"] == [300] * 4 != a["choices"][0]["token_ids"],
                     "random", logit_bias={"300": 5}),
    "min_tokens": changes(8, lambda a, b: b["usage"]["completion_tokens"] == 8 > a["usage"]["completion_tokens"]),
    # the greeting becomes JSON that follows the schema (strict: no other properties)
    "response_format": changes({"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
                               lambda a, b: json.loads(texts(b)[0]) == {"city": "Paris"}, max_tokens=24),
    **{name: metadata({"team": "a"} if name == "metadata" else "client-7") for name in METADATA_FIELDS},
}
FIELDS = {
    "/v1/completions": {
        **GENERATION,
        "prompt": changes("Paris, France", prompt_tokens_differ),
        "echo": changes(True, lambda a, b: texts(b) == [BASES["/v1/completions"]["prompt"] + texts(a)[0]]),
        "best_of": refused(3),  # only best_of == n
        "logprobs": changes(2, lambda a, b: a["choices"][0]["logprobs"] is None and
                            len(b["choices"][0]["logprobs"]["token_logprobs"]) == b["usage"]["completion_tokens"]),
        "suffix": refused("!"),
    },
    "/v1/chat/completions": {
        **GENERATION,
        "max_completion_tokens": changes(2, lambda a, b: b["usage"]["completion_tokens"] == 2),
        "logprobs": changes(True, lambda a, b: a["choices"][0]["logprobs"] is None and
                            len(b["choices"][0]["logprobs"]["content"]) == b["usage"]["completion_tokens"]),
        "top_logprobs": changes(2, lambda a, b: all(len(e["top_logprobs"]) == 2
                                                    for e in b["choices"][0]["logprobs"]["content"]), logprobs=True),
        "messages": changes([{"role": "user", "content": "Hi there"}], prompt_tokens_differ),
        "tools": changes(TOOLS, lambda a, b: calls(b) == ["get_weather", "get_time"], max_tokens=20),
        "tool_choice": changes({"type": "function", "function": {"name": "get_time"}},
                               lambda a, b: calls(a) == ["get_weather", "get_time"] and calls(b) == ["get_time"],
                               "tools"),
        "parallel_tool_calls": changes(False, lambda a, b: calls(b) == calls(a)[:1], "tools"),
        "documents": changes([{"title": "Atlas", "text": "Paris is in France."}], prompt_tokens_differ),
        "chat_template_kwargs": changes({"system_prompt": "Be brief."}, prompt_tokens_differ),
        # Seeded: without the assistant's header the model draws uniformly, and an unseeded draw can land on the
        # header and greet after all (CI, 2026-12-03: the same text in 7 tokens instead of 4).
        "add_generation_prompt": changes(False, lambda a, b: texts(a) != texts(b) and prompt_tokens_differ(a, b),
                                         seed=1),
        "continue_final_message": changes(True, prompt_tokens_differ, "random", continue_final_message=False),
        "include_reasoning": refused(False),  # this model does not think (test_reasoning shows one that does)
        "thinking_token_budget": refused(8),  # the same
        **{name: refused(value) for name, value in {
            "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text"], "function_call": "auto",
            "functions": [{"name": "f"}], "prediction": {"type": "content", "content": "x"},
            "reasoning_effort": "low", "service_tier": "auto",
            "store": True, "verbosity": "low", "web_search_options": {}, "prompt_cache_key": "k",
            "prompt_cache_retention": "24h", "prompt_cache_options": {}, "moderation": {}}.items()},
    },
}
TYPES = {"/v1/completions": (completion_params.CompletionCreateParamsStreaming, CompletionRequest),
         "/v1/chat/completions": (chat_params.CompletionCreateParamsStreaming, ChatCompletionRequest)}


@functools.cache
def _post(base: str, route: str, body: str) -> tuple[int, dict | str]:
    r = requests.post(f"{base}{route}", data=body, headers={"Content-Type": "application/json"}, timeout=60)
    return r.status_code, r.text if r.headers["content-type"].startswith("text/event-stream") else r.json()


def post(base: str, route: str, body: dict) -> tuple[int, dict | str]:
    """The answer to ``body`` (a base request's is asked once: the answers are deterministic)."""
    return _post(base, route, json.dumps(body, sort_keys=True))


@pytest.mark.parametrize("route", list(TYPES))
def test_every_field_is_classified(route):
    openai_type, model = TYPES[route]
    assert set(FIELDS[route]) == set(typing.get_type_hints(openai_type)) | set(model.model_fields)


@pytest.mark.parametrize("route,name", [(r, n) for r in FIELDS for n in FIELDS[r]], ids=lambda x: x)
def test_a_field_has_an_effect_or_answers_400_naming_it(k2_chat, route, name):
    kind, value, *how = FIELDS[route][name]
    if kind == "changes":
        effect, base, extra = how
        before = {**BASES[f"{route} {base}".strip()], **extra}
    else:
        before = BASES[route]
    status, answer = post(k2_chat, route, {**before, name: value})
    if kind == "refused":
        assert status == 400 and answer["error"]["param"] == name, answer
    elif kind == "metadata":
        assert status == 200 and texts(answer) == texts(post(k2_chat, route, before)[1])
    else:
        status_before, answer_before = post(k2_chat, route, before)
        assert status_before == 200, answer_before
        assert effect(answer_before, answer), json.dumps([answer_before, answer])[:2000]


def test_best_of_equal_to_n_is_served_and_echo_with_logprobs_scores_the_prompt(k2_chat):
    status, answer = post(k2_chat, "/v1/completions", {**BASES["/v1/completions"], "n": 2, "best_of": 2})
    assert status == 200 and len(answer["choices"]) == 2
    for max_tokens in (8, 0):  # 0: the prompt alone (lm-eval-harness' loglikelihood requests)
        status, answer = post(k2_chat, "/v1/completions", {**BASES["/v1/completions"], "echo": True, "logprobs": 1,
                                                           "max_tokens": max_tokens})
        lp, used = answer["choices"][0]["logprobs"], answer["usage"]
        assert status == 200 and len(lp["tokens"]) == used["prompt_tokens"] + used["completion_tokens"]
        assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
        assert (used["completion_tokens"] == 0) == (max_tokens == 0)
