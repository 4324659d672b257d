"""Tokenizer backends (tokenizers, Kimi-K2's tiktoken layout), chat templates against transformers, the template
sandbox, and incremental detokenization. Tiny vocabularies are trained on the fly."""
from __future__ import annotations

import base64
import json
import pickle
import random

import pytest
import regex
import tiktoken
import tokenizers
import transformers
from tiktoken._educational import bpe_train
from tokenizers import decoders, models, pre_tokenizers, trainers

from kdray.model.tokenizer import (CACHED_PIECE_CHARS, KIMI_PATTERN, TIKTOKEN_MAX_CHARS, TIKTOKEN_MAX_RUN,
                                   ChatTemplateError, IncrementalDetokenizer, TiktokenBackend, Tokenizer,
                                   cached_piece_ids, tiktoken_chunks)

# Kimi-K2's named special tokens, offsets from the first special id (= the number of BPE ranks)
K2_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
               6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
               13: "<|tool_calls_section_begin|>", 14: "<|tool_calls_section_end|>", 15: "<|tool_call_begin|>",
               16: "<|tool_call_argument_begin|>", 17: "<|tool_call_end|>", 18: "<|im_middle|>", 22: "<think>",
               23: "</think>", 255: "[PAD]"}  # <think> and </think>: K2-Thinking's

# K2-style: a tool declaration turn, <|im_*|> role markers, tool calls in their section, a tool turn under system
CHAT_TEMPLATE = """
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and message.role != 'system' -%}
<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>
  {%- endif -%}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool'] -%}
    {{- raise_exception('roles are system, user, assistant and tool, not ' ~ message.role) -}}
  {%- endif -%}
<|im_{{ 'system' if message.role == 'tool' else message.role }}|>{{ message.name or message.role }}<|im_middle|>
  {%- if message.role == 'tool' -%}## Return of {{ message.tool_call_id }}
{% endif -%}
  {%- if message.content is string -%}{{ message.content }}
  {%- else -%}{%- for part in message.content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
  {%- endif -%}
  {%- if message.tool_calls -%}
<|tool_calls_section_begin|>
    {%- for call in message.tool_calls -%}
<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>{{ call.function.arguments }}<|tool_call_end|>
    {%- endfor -%}
<|tool_calls_section_end|>
  {%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""

# transformers' helpers: strftime_now, tojson's options, loop controls, {% generation %}, documents, extra kwargs
HELPERS_TEMPLATE = """{{- bos_token -}}
Date: {{ strftime_now('%Y-%m') }}; thinking: {{ thinking | default('unset') }}
{% for message in messages %}
{% if message.role == 'system' %}{% continue %}{% endif %}
{% if loop.index > 4 %}{% break %}{% endif %}
{% generation %}{{ message.role }}: {{ message.content | tojson }}{% endgeneration %}

{{ message | tojson(indent=2, sort_keys=True) }} {{ {'é': [1, 2]} | tojson(ensure_ascii=True, separators=(',', ':')) }}
{% endfor %}
{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}assistant:{% else %}{{ eos_token }}{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city — today",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
USER = {"role": "user", "content": "What's the weather in Zürich?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "functions.get_weather:0", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]}
TOOL = {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "12°C, rain"}
CHATS = {
    "plain": ([USER, {"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "Thanks"}], {}),
    "system": ([{"role": "system", "content": "Be brief."}, USER], {}),
    "tools": ([USER], {"tools": TOOLS}),
    "tool_calls": ([USER, CALL, TOOL], {"tools": TOOLS}),
    "text_parts": ([{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "你好"}]},
                    {"role": "assistant", "content": "Hi", "tool_calls": None}], {}),
    "continue": ([USER, {"role": "assistant", "content": "It is "}], {"continue_final_message": True,
                                                                       "add_generation_prompt": False}),
    "continue_parts": ([USER, {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}],
                       {"continue_final_message": True, "add_generation_prompt": False}),
    "no_generation_prompt": ([USER], {"add_generation_prompt": False}),
}

TEXTS = ["Hello, world!", "  leading spaces,\ttabs and\n\nnewlines  \n", "digits 12345 and 3.14159, x²",
         "café — naïve 日本語のテキスト 你好世界 🙂🚀", "I'm sure they'll say HTTPServer isn't READY'S",
         "def f(x):\n    return x**2  # square", "<|im_user|>user<|im_middle|>hi there<|im_end|>"]
SYLLABLES = ["ka", "mi", "to", "ren", "ize", "the", "ing", "qu", "é", "ñ", "ü", "的", "是", "语言", "日本", "🙂", "12",
             "345", ", ", ".\n", "  ", "I'm", " HTTP"]


def training_text(words: int) -> str:
    rng = random.Random(0)
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(words))


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    """256 single bytes and 150 merges (multi-byte characters among them), from tiktoken's educational trainer."""
    return bpe_train(training_text(600), 256 + 150, r" ?\w+| ?[^\s\w]+|\s+", visualise=None)


def write_k2_dir(path, ranks: dict[bytes, int], template_file: bool = False):
    """Kimi-K2's tokenizer layout: tiktoken.model, tokenizer_config.json (and maybe chat_template.jinja)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    conf = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
            "added_tokens_decoder": {str(n + k): {"content": t, "special": True} for k, t in K2_SPECIALS.items()}}
    if template_file:
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
        conf["chat_template"] = "overridden by chat_template.jinja"
    else:
        conf["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(conf))
    return path


@pytest.fixture(scope="module")
def k2(ranks, tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_k2_dir(tmp_path_factory.mktemp("k2"), ranks))


@pytest.fixture(scope="module")
def reference(ranks) -> tiktoken.Encoding:
    """tiktoken itself with K2's pattern and special block: ids n..n+255, unnamed ones <|reserved_token_{id}|>."""
    n = len(ranks)
    specials = {K2_SPECIALS.get(i - n, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding("reference", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


HF_SPECIALS = ["<s>", "</s>", *sorted(set(K2_SPECIALS.values()))]


@pytest.fixture(scope="module")
def hf_backend() -> tokenizers.Tokenizer:
    """A byte-level BPE (as SmolLM2's) with K2's marker tokens as special tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=HF_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(2000).split(".\n"), trainer)
    return tok


def ours_and_hf(backend: tokenizers.Tokenizer, template: str):
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    ours = Tokenizer(backend, (backend.token_to_id("</s>"),), backend.token_to_id("<s>"), template, "<s>", "</s>")
    return ours, hf


# ---------------------------------------------------------------- tiktoken (Kimi-K2 layout)

def test_kimi_pattern_pieces():
    pieces = regex.findall(KIMI_PATTERN, "Hello世界 I'm 12345 HTTPServer don't\n\n  x+=1", flags=regex.V1)
    assert pieces == ["Hello", "世界", " I'm", " ", "123", "45", " HTTPServer", " don't", "\n\n", " ", " x", "+=",
                      "1"]


def test_tiktoken_encode_decode_match_tiktoken(k2, reference, ranks):
    n = len(ranks)
    assert isinstance(k2.backend, TiktokenBackend) and k2.backend.num_ranks == n
    for text in [*TEXTS, " " * 7 + "\n" * 3 + "\t x", "0123456789" * 3, "[BOS]a[EOS]<|reserved_token_%d|>" % (n + 77)]:
        ids = k2.encode(text)
        assert ids == reference.encode(text, allowed_special="all"), text
        assert k2.decode(ids) == reference.decode([i for i in ids if i < n])
    assert k2.encode("a<|im_end|>b") == [ord("a"), n + 2, ord("b")]
    assert k2.decode(k2.encode("a<|im_end|>b<|reserved_token_%d|>c" % (n + 200))) == "abc"  # specials skipped
    assert (k2.bos_token_id, k2.eos_token_ids, k2.bos_token, k2.eos_token) == (n, (n + 1,), "[BOS]", "[EOS]")
    assert [k2.backend.token_to_id(t) for t in ("[PAD]", "<|reserved_token_%d|>" % (n + 5), "ka", "nope")] == \
        [n + 255, n + 5, ranks[b"ka"], None]
    assert len(k2.backend.get_added_tokens_decoder()) == 256


def test_tiktoken_long_runs_are_cut_like_kimi(k2, reference):
    run = "a" * (2 * TIKTOKEN_MAX_RUN + 10)
    text = "x " + run + "  y"
    head = "x " + "a" * TIKTOKEN_MAX_RUN  # the run is cut every TIKTOKEN_MAX_RUN characters from its start
    pieces = [head, "a" * TIKTOKEN_MAX_RUN, "a" * 10 + "  y"]
    assert k2.encode(text) == [i for p in pieces for i in reference.encode(p)]
    assert k2.decode(k2.encode(text)) == text
    assert [len(c) for c in tiktoken_chunks("ab " * 150_000)] == [TIKTOKEN_MAX_CHARS, 50_000]  # no long run


def test_k2_chat_prompt_encodes_its_special_tokens(k2, reference, ranks, tmp_path):
    n = len(ranks)
    text = k2.apply_chat_template(CHATS["tool_calls"][0], tools=TOOLS)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>[{\"type\":\"function\"")
    assert text.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = k2.encode(text)
    assert ids == reference.encode(text, allowed_special="all")
    assert (ids[0], ids[-1]) == (n + 10, n + 18)  # <|im_system|> ... <|im_middle|>
    assert {n + 2, n + 3, n + 4, n + 13, n + 14, n + 15, n + 16, n + 17} <= set(ids)
    k2_file = Tokenizer.from_dir(write_k2_dir(tmp_path / "k2", ranks, template_file=True))
    assert k2_file.chat_template == CHAT_TEMPLATE  # chat_template.jinja wins over tokenizer_config.json's


def test_tiktoken_files_missing_or_corrupt(ranks, tmp_path):
    good = write_k2_dir(tmp_path / "good", ranks)
    lines = (good / "tiktoken.model").read_text().splitlines()
    cases = {
        "not base64": ["!!notbase64!! 0", *lines[1:]],
        "rank not a number": [lines[0].split()[0] + " zero", *lines[1:]],
        "gap in the ranks": [*lines[:100], *lines[101:]],
        "no single bytes": lines[256:],
    }
    for i, (case, body) in enumerate(cases.items()):
        bad = write_k2_dir(tmp_path / f"bad{i}", ranks)
        (bad / "tiktoken.model").write_text("\n".join(body) + "\n")
        with pytest.raises(ValueError, match=r"tiktoken\.model.*copy tiktoken\.model from the checkpoint"):
            Tokenizer.from_dir(bad)
    (good / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="tokenizer_config.json: missing or without added_tokens_decoder"):
        Tokenizer.from_dir(good)
    (good / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: cannot be read as JSON"):
        Tokenizer.from_dir(good)
    (good / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "[BOS]"}}}))
    with pytest.raises(ValueError, match="fall inside the 406 BPE ranks of tiktoken.model"):
        Tokenizer.from_dir(good)
    (good / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TikTokenTokenizer"}))
    (good / "tiktoken.model").unlink()
    with pytest.raises(ValueError, match=r"tiktoken\.model is missing"):
        Tokenizer.from_dir(good)
    assert Tokenizer.from_dir(tmp_path / "empty_dir_without_tokenizer") is None


# ---------------------------------------------------------------- chat templates against transformers

@pytest.mark.parametrize("name", CHATS)
def test_chat_template_matches_transformers(hf_backend, name):
    messages, kwargs = CHATS[name]
    ours, hf = ours_and_hf(hf_backend, CHAT_TEMPLATE)
    kwargs = {"add_generation_prompt": True, **kwargs}
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    if kwargs.get("continue_final_message"):
        assert text.endswith("<|im_assistant|>assistant<|im_middle|>It is" + " " * (name == "continue"))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_helpers_match_transformers(hf_backend, add_generation_prompt):
    ours, hf = ours_and_hf(hf_backend, HELPERS_TEMPLATE)
    messages = [{"role": "system", "content": "skipped"}, *CHATS["plain"][0], *CHATS["plain"][0]]
    kwargs = {"tools": TOOLS, "documents": [{"title": "Doc", "text": "Zürich is in Switzerland."}],
              "add_generation_prompt": add_generation_prompt, "thinking": True}
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert "\\u00e9" in text and "Zürich" in text and "thinking: True" in text


def test_raise_exception_matches_transformers(hf_backend):
    ours, hf = ours_and_hf(hf_backend, CHAT_TEMPLATE)
    robot = [{"role": "robot", "content": "beep"}]
    with pytest.raises(Exception, match="not robot"):
        hf.apply_chat_template(robot, tokenize=False)
    with pytest.raises(ChatTemplateError, match="^chat template: roles are system, user, assistant and tool, "
                                                "not robot$"):
        ours.apply_chat_template(robot)


def test_continue_final_message_errors(hf_backend):
    ours, _ = ours_and_hf(hf_backend, CHAT_TEMPLATE)
    with pytest.raises(ValueError, match="exclude each other"):
        ours.apply_chat_template(CHATS["continue"][0], continue_final_message=True)
    with pytest.raises(ValueError, match="final message is from 'user'"):
        ours.apply_chat_template([USER], continue_final_message=True, add_generation_prompt=False)
    drops = Tokenizer(hf_backend, chat_template="{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="does not render the final message's content"):
        drops.apply_chat_template(CHATS["continue"][0], continue_final_message=True, add_generation_prompt=False)


def test_named_chat_templates(hf_backend, tmp_path):
    hf_backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools: {{ tools | length }}"}]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.apply_chat_template([USER]), tok.apply_chat_template([USER], tools=TOOLS)) == ("plain", "tools: 1")


# ---------------------------------------------------------------- the sandbox

def test_sandbox_violation_raises_and_does_not_run(hf_backend, tmp_path):
    marker = tmp_path / "escaped"
    escapes = ["{{ messages.__class__.__mro__[1].__subclasses__() }}",
               "{{ cycler.__init__.__globals__.os.system('touch %s') }}" % marker,
               "{{ messages.append(1) }}"]
    for template in escapes:
        with pytest.raises(ChatTemplateError, match="chat template was stopped by the sandbox: access to attribute"):
            Tokenizer(hf_backend, chat_template=template).apply_chat_template([USER])
    assert not marker.exists()


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m.content }}", r"syntax error at line 1: Unexpected end of template"),
    ("{{ undefined_helper(messages) }}", r"uses something undefined: 'undefined_helper' is undefined"),
    ("{{ raise_exception('no robots here') }}", r"^chat template: no robots here$"),
    ("{{ 1 // 0 }}", r"failed while rendering: ZeroDivisionError"),
])
def test_template_errors_name_the_cause(hf_backend, template, message):
    with pytest.raises(ChatTemplateError, match=message):
        Tokenizer(hf_backend, chat_template=template).apply_chat_template([USER])


# ---------------------------------------------------------------- incremental detokenization

class CountingBackend:
    """A backend that records how many ids each decode call is given."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def decode(self, ids: list[int]) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def byte_level_char(b: int) -> str:
    """GPT-2's byte -> character map (the ByteLevel alphabet): printable Latin-1 bytes are themselves."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    return chr(b) if b in kept else chr(256 + [x for x in range(256) if x not in kept].index(b))


@pytest.fixture(scope="module")
def both(k2, hf_backend) -> dict[str, tuple[Tokenizer, list[int]]]:
    """Each backend's tokenizer with the ids of its 256 single bytes."""
    hf = Tokenizer(hf_backend)
    return {"tiktoken": (k2, list(range(256))),
            "tokenizers": (hf, [hf_backend.token_to_id(byte_level_char(b)) for b in range(256)])}


def random_stream(rng: random.Random, tok: Tokenizer, byte_ids: list[int], vocab: int, n: int) -> list[int]:
    """Whole-text tokens, characters split byte by byte, any id (invalid UTF-8 too) and special ids, mixed."""
    specials = [tok.backend.token_to_id(t) for t in ("<|im_end|>", "<|im_user|>")]
    ids = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.35:
            ids += tok.encode(rng.choice(TEXTS))
        elif kind < 0.7:
            ids += [byte_ids[b] for b in rng.choice(SYLLABLES).encode()]
        elif kind < 0.95:
            ids.append(rng.randrange(vocab))
        else:
            ids.append(rng.choice(specials))
    return ids


@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_incremental_text_equals_whole_decode(both, backend):
    tok, byte_ids = both[backend]
    rng = random.Random(1)
    prompt = tok.encode("Question: why?")
    for _ in range(40):
        ids = random_stream(rng, tok, byte_ids, 400, rng.randint(1, 150))
        det = IncrementalDetokenizer(tok, prompt if rng.random() < 0.5 else None)
        pieces, at = [], 0
        while at < len(ids):
            step = rng.randint(1, 3)
            pieces.append(det.add(ids[at:at + step]))
            at += step
        pieces.append(det.flush())
        assert "".join(pieces) == tok.decode(ids)


@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_unfinished_character_is_held_back(both, backend):
    tok, byte_ids = both[backend]
    det = IncrementalDetokenizer(tok)
    assert [det.add([byte_ids[b]]) for b in "a方🙂".encode()] == ["a", "", "", "方", "", "", "", "🙂"]
    assert det.add([byte_ids[0xE6]]) == "" and det.flush() == "\ufffd"


@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_decode_work_per_call_is_bounded(both, backend):
    tok, byte_ids = both[backend]
    counting = Tokenizer(CountingBackend(tok.backend))
    rng = random.Random(2)
    most = {}
    for n in (100, 2000):  # output ids, then 100 invalid bytes (each text ends in U+FFFD: held as long as allowed)
        ids = random_stream(rng, tok, byte_ids, 400, n) + [byte_ids[0x80]] * 100
        det = IncrementalDetokenizer(counting, tok.encode("a long prompt " * 50))
        counting.backend.sizes.clear()
        assert "".join(det.add([i]) for i in ids) + det.flush() == tok.decode(ids)
        most[n] = max(counting.backend.sizes)
    bound = IncrementalDetokenizer.CONTEXT + IncrementalDetokenizer.MAX_HELD
    assert most == {100: bound, 2000: bound}


# ---------------------------------------------------------------- long texts encoded piece by piece, from a cache

@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_long_texts_cut_at_special_tokens_encode_as_a_whole(both, backend):
    """A long text is cut at its special tokens and its long pieces come from a cache: the ids are the backend's
    for the whole text, with whitespace, digits and multi-byte characters on either side of the cuts."""
    tok, _ = both[backend]
    cached_piece_ids.cache_clear()
    specials = [t.content for t in tok.backend.get_added_tokens_decoder().values()]
    system = training_text(400)
    assert len(system) >= CACHED_PIECE_CHARS and tok.backend.special_cuts(system) is not None
    rng = random.Random(3)
    for _ in range(40):
        parts = [system]
        for _ in range(rng.randint(1, 5)):
            parts += [rng.choice(specials), rng.choice([system[:rng.randint(0, 2000)], " ", "\n\n", "  12 3", "é世 x", ""])]
        text = "".join(parts)
        assert tok.encode(text) == tok.backend.encode(text)
    assert cached_piece_ids.cache_info().hits >= 39  # the shared piece was encoded once


def test_a_tokenizer_with_its_cache_pickles(both):
    """A tokenizer pickles (the piece cache is module-level, not part of it) and its copy encodes the same."""
    tok, _ = both["tokenizers"]
    text = training_text(400) + "</s>"
    assert pickle.loads(pickle.dumps(tok)).encode(text) == tok.encode(text)


def test_tokens_that_strip_their_neighbours_keep_the_text_whole(hf_backend):
    """An added token that strips the whitespace after it makes its neighbour's ids depend on it: no cuts."""
    backend = tokenizers.Tokenizer.from_str(hf_backend.to_str())
    backend.add_special_tokens([tokenizers.AddedToken("<|strip|>", rstrip=True, normalized=False)])
    tok = Tokenizer(backend)
    text = training_text(400) + "<|strip|>   after it" + "</s>"
    assert tok.backend.special_cuts(text) is None
    assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_tiktoken_long_runs_keep_the_text_whole(k2, reference):
    """Over TIKTOKEN_MAX_RUN, Kimi's chunks are cut from the run's start in the whole text: no cuts at specials."""
    text = "x<|im_end|>" + "a" * (TIKTOKEN_MAX_RUN + 5) + "<|im_end|>y"
    assert k2.backend.special_cuts(text) is None
    assert k2.backend.special_cuts(text[:CACHED_PIECE_CHARS]) is not None
    assert k2.encode(text) == [i for p in tiktoken_chunks(text) for i in reference.encode(p, allowed_special="all")]
