"""Request bounds without a server: every number a request carries is bounded, in the OpenAI request models
(a 400 naming the field) and again in ``SamplingParams`` (a ``ValueError`` naming it), and a body that is not
a sane JSON object is a 400, never a 500."""
import json

import pytest

from kdray import SamplingParams
from kdray.engine.request import MAX_SEED, MAX_TOKENS, MAX_TOP_K
from kdray.serve.protocol import (MAX_JSON_DEPTH, APIError, ChatCompletionRequest, CompletionRequest, parse_json,
                                  validate)

BASE = {"model": "m", "prompt": [1]}


@pytest.mark.parametrize("field,value", [
    ("seed", MAX_SEED + 1), ("seed", -1), ("top_k", MAX_TOP_K + 1), ("top_k", -2), ("max_tokens", MAX_TOKENS + 1),
    ("n", 17), ("temperature", 2.5), ("top_p", 0), ("stop", ["x"] * 17), ("stop", "x" * 1025),
])
def test_request_numbers_are_bounded(field, value):
    with pytest.raises(APIError) as e:
        validate(CompletionRequest, {**BASE, field: value})
    assert e.value.status == 400 and e.value.param == field and e.value.message.startswith(f"{field}: ")


def test_every_choice_seed_fits_63_bits():
    validate(CompletionRequest, {**BASE, "seed": MAX_SEED - 1, "n": 2})
    with pytest.raises(APIError, match=r"seed: with n=2, seed \+ n - 1 must be at most 2\^63 - 1") as e:
        validate(CompletionRequest, {**BASE, "seed": MAX_SEED, "n": 2})
    assert e.value.param == "seed"
    with pytest.raises(APIError) as e:
        validate(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "max_completion_tokens": MAX_TOKENS + 1})
    assert e.value.param == "max_completion_tokens"


def test_the_bounds_themselves_are_accepted():
    req = validate(CompletionRequest, {**BASE, "seed": MAX_SEED, "top_k": MAX_TOP_K, "max_tokens": MAX_TOKENS})
    SamplingParams(max_tokens=req.max_tokens, top_k=req.top_k, seed=req.seed)


SAMPLING_BAD = [("seed", MAX_SEED + 1), ("seed", -1), ("seed", 10**5000), ("top_k", MAX_TOP_K + 1),
                ("top_k", True), ("max_tokens", MAX_TOKENS + 1), ("temperature", float("nan")),
                ("temperature", float("inf")), ("top_p", float("nan"))]


@pytest.mark.parametrize("field,value", SAMPLING_BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(SAMPLING_BAD)])
def test_sampling_params_are_bounded(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.+ must be"):
        SamplingParams(**{field: value})


BAD_BODIES = [
    (b'{"temperature": NaN}', "NaN is not a JSON number"),
    (b'{"temperature": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"seed": 1' + b"0" * 5000 + b"}", "4300 digits"),
    (b"[" * 10_000 + b"]" * 10_000, "nested too deeply"),
    (b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "a: nests arrays or objects deeper than"),
    (b'{"prompt": "\\ud800"}', r"prompt: holds a lone UTF-16 surrogate"),
    (b'{"messages": [{"content": "ok \\udfff"}]}', r"messages\[0\]\.content: holds a lone"),
    (b'{"\\ud800": 1}', r"\\ud800: holds a lone"),
    (b"\xff\xfe", "malformed JSON"),
    (b'"text"', "must be a JSON object, not str"),
]


@pytest.mark.parametrize("raw,message", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_a_body_that_is_no_sane_json_object_is_a_400(raw, message):
    with pytest.raises(APIError, match=message) as e:
        parse_json(raw)
    assert e.value.status == 400
    json.dumps(e.value.body()).encode()  # the error itself is valid text


def test_valid_text_passes_the_body_checks():
    body = {"prompt": "emoji \ud83d\ude00 ok", "nested": [[[1]]], "ids": list(range(1000))}
    assert parse_json(json.dumps(body).encode()) == {**body, "prompt": "emoji 😀 ok"}
