"""Constrained decoding (kdray.spec.grammar): token bytes of both tokenizer back-ends, each tree node's mask against
a matcher fed the node's path, AR == chain == DDTree under a grammar (greedy and seeded; drafts that rarely agree and
an oracle's), a plain request batched with grammar ones untouched, the same under preemption, output that parses
and validates, forced tool calls in K2's and Hermes' formats, and the 400s; served through the OpenAI handlers
in-process."""
import dataclasses
import json
import random

import jsonschema
import pytest
import torch
from k2_chat import TOOLS, token_ids
from test_ddtree import oracle
from test_mixed_traffic import chosen_logprobs
from test_serving_sampling import call, serving  # noqa: F401 - serving is a fixture
from test_tokenizer import hf_backend  # noqa: F401 - a fixture

from kdray import LLM, SamplingParams, StructuredOutputsParams
from kdray.kernels.tree_build import DraftTree
from kdray.model.tokenizer import TiktokenBackend, Tokenizer
from kdray.serve.protocol import APIError
from kdray.serve.tool_calls import ToolCallParser, ToolText
from kdray.spec.grammar import (SPECIAL_LEAD, Grammars, GrammarState, after_reasoning, masked, next_token_masks,
                                token_bytes, tree_masks)

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["ada", "bob"]}, "b": {"type": "boolean"},
                                           "c": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "d": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
          "required": ["a", "b", "c", "d"], "additionalProperties": False}
GRAMMAR = StructuredOutputsParams(json=SCHEMA)
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [300, 2, 9]]
PLAIN = [9, 8, 7, 6]  # a plain request batched with the grammar ones
# PROMPTS' requests under the grammar (two greedy, one seeded) and PLAIN's, seeded: the mix the engine-level tests run
MIXED = [SamplingParams(max_tokens=40, structured_outputs=GRAMMAR)] * 2 + [
    SamplingParams(max_tokens=40, structured_outputs=GRAMMAR, temperature=1.0, seed=7),
    SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=3)]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engines(random_k2):
    return {"ar": LLM(model=random_k2, spec="ar"),
            "chain": LLM(model=random_k2, drafter="random", spec="chain", block_size=8),
            "ddtree": LLM(model=random_k2, drafter="random", spec="ddtree", budget=16, block_size=8)}


def test_token_bytes_are_what_decoding_writes(engines, hf_backend):  # noqa: F811
    """Concatenated, an id sequence's bytes decode to the tokenizer's text; special ids are SPECIAL_LEAD and their
    name; ids past the tokenizer's vocabulary are empty."""
    rng = random.Random(0)
    k2 = engines["ar"].tokenizer
    for tok in (k2, Tokenizer(hf_backend)):
        specials = {i: t.content for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
        vocab = 1 + max(i for i, b in enumerate(token_bytes(tok, 4096)) if b)
        table = token_bytes(tok, vocab + 5)
        assert table[vocab:] == [b""] * 5
        assert all(table[i] == SPECIAL_LEAD + name.encode() for i, name in specials.items())
        ordinary = [i for i in range(vocab) if i not in specials and table[i]]
        assert len(ordinary) > 250
        for _ in range(50):
            ids = rng.choices(ordinary, k=rng.randint(1, 12))
            assert b"".join(table[i] for i in ids).decode(errors="replace") == tok.decode(ids)


def test_each_nodes_mask_is_the_matchers_after_its_path(engines):
    """Random trees whose nodes mostly follow the grammar: every node's row is the mask of a fresh matcher fed the
    committed tokens and the node's path (the root is committed already); nodes no allowed path reaches, and rows
    without a grammar, allow everything. The request's matcher is left where it was."""
    llm = engines["ar"]
    grammars, tok, V = llm.engine.grammars, llm.tokenizer, llm.config.vocab_size
    committed = tok.encode('{"a": "')
    rng = random.Random(1)

    def fresh(path: list[int]):
        """A matcher after ``committed + path``, or None where the grammar refuses the path or has ended."""
        state = grammars.start(GRAMMAR)
        if not all(state.matcher.accept_token(t) for t in committed + path) or state.ended:
            return None
        return state

    def mask(state) -> torch.Tensor:
        row = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32)
        if state is not None:
            state.matcher.fill_next_token_bitmask(row)
        return row[0]

    def allowed(row: torch.Tensor) -> list[int]:
        return [t for t in range(V) if row[t // 32] >> (t % 32) & 1]

    for _ in range(3):
        n, paths = 24, [[]]
        tokens, parents = [committed[-1]], [-1]
        for _ in range(n - 1):
            p = rng.randrange(len(tokens))
            state = fresh(paths[p])
            good = allowed(mask(state)) if state is not None else []
            t = rng.choice(good) if good and rng.random() < 0.8 else rng.randrange(V)
            tokens.append(t), parents.append(p), paths.append(paths[p] + [t])
        width = n + 3  # unused slots past num_nodes
        tree = DraftTree(tokens=torch.tensor([tokens + [0] * 3, [7] * width]),
                         parents=torch.tensor([parents + [-1] * 3, [-1] + [0] * (width - 1)], dtype=torch.int32),
                         depths=None, num_nodes=torch.tensor([n, width], dtype=torch.int32), mask=None)
        state = fresh([])
        before = mask(state)
        got = tree_masks([state, None], tree, V)
        assert got.shape == (2 * width, (V + 31) // 32)
        for i, path in enumerate(paths):
            assert torch.equal(got[i], mask(fresh(path))), i
        assert (got[n:] == -1).all()
        assert torch.equal(mask(state), before)
        assert sum(fresh(p) is not None for p in paths) > n // 2  # deep valid paths were walked


def test_a_length_bounded_string_takes_json_characters_alone(engines):
    """A string with minLength / maxLength (which xgrammar 0.2 writes as a repeated character that lets raw control
    characters in, mlc-ai/xgrammar#800, invalid JSON): none is taken; the bounds hold. The same after a free thought.
    Bytes are fed as the tokenizer's one-byte tokens."""
    llm = engines["ar"]
    eos = next(iter(llm.engine.eos_token_ids))
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
              "required": ["s"], "additionalProperties": False}
    cases = {b'{"s": "ab"}': True, b'{"s": "a\tb"}': False, b'{"s": "a\x02"}': False, b'{"s": "a\x1f"}': False,
             b'{"s": "abcd"}': True, b'{"s": "abcde"}': False, b'{"s": "a"}': False}
    for grammar, prefix in [(StructuredOutputsParams(json=schema), []),
                            (after_reasoning(StructuredOutputsParams(json=schema), THINK, THINK_END, False),
                             [THINK, 300, THINK_END])]:
        for text, valid in cases.items():
            state = llm.engine.grammars.start(grammar)
            taken = all(state.matcher.accept_token(t) for t in [*prefix, *text, eos])
            assert taken == valid, (text, prefix)


def test_masked_sets_the_excluded_logits_to_minus_infinity():
    g = torch.Generator().manual_seed(2)
    logits, bits = torch.randn(3, 70, generator=g), torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g).int()
    out = masked(logits, bits)
    for r in range(3):
        for t in range(70):
            keep = (int(bits[r, t // 32]) >> (t % 32)) & 1
            assert out[r, t].item() == (logits[r, t].item() if keep else float("-inf"))


def generate(llm: LLM, params: list[SamplingParams]):
    return [o.outputs[0] for o in llm.generate(prompt_token_ids=PROMPTS + [PLAIN], sampling_params=params)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_chain_and_ddtree_emit_ar_tokens_under_a_grammar(engines, sampled):
    """Grammar requests (and a plain one batched with them) give AR's tokens under chain and DDTree, with an oracle's
    drafts (long paths accepted, wrong siblings beside them: each node's mask must follow its path) and, greedy, with
    random ones; the outputs that end parse and follow the schema, and the plain one is what it is alone."""
    how = dict(temperature=1.0, seed=7) if sampled else {}
    params = [SamplingParams(max_tokens=48, structured_outputs=GRAMMAR, **how)] * len(PROMPTS) + [
        SamplingParams(max_tokens=12, ignore_eos=True, **how)]
    ar = generate(engines["ar"], params)
    for spec, drafts in [("chain", "oracle"), ("ddtree", "oracle")] + ([] if sampled else [("ddtree", "random")]):
        llm = engines[spec]
        if drafts == "oracle":
            oracle(llm, {tuple(p): p + c.token_ids for p, c in zip(PROMPTS + [PLAIN], ar)})
        outs = llm.generate(prompt_token_ids=PROMPTS + [PLAIN], sampling_params=params)
        llm.engine.runner.__dict__.pop("draft", None)
        assert [o.outputs[0].token_ids for o in outs] == [c.token_ids for c in ar], (spec, drafts)
        if drafts == "oracle":
            assert min(o.metrics["tau"] for o in outs[:-1]) > 4
    ended = [c for c in ar[:-1] if c.finish_reason == "stop"]
    assert ended
    for c in ended:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    alone = engines["ar"].generate(prompt_token_ids=[PLAIN], sampling_params=params[-1])[0].outputs[0]
    assert ar[-1].token_ids == alone.token_ids
    free = engines["ar"].generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=12, **how))
    assert [o.outputs[0].token_ids for o in free] != [c.token_ids[:12] for c in ar[:-1]]  # the grammar acted


THINK, THINK_END = token_ids()["<think>"], token_ids()["</think>"]


def thinking_params(opened: bool, **how) -> list[SamplingParams]:
    """PROMPTS' requests under GRAMMAR after a free thought (a bias opens it, others end it soon or late), PLAIN's."""
    grammar = after_reasoning(GRAMMAR, THINK, THINK_END, opened)
    return [SamplingParams(max_tokens=48, structured_outputs=grammar, logit_bias={THINK: 30.0, THINK_END: bias}, **how)
            for bias in (6.0, 7.0, 8.0)] + [SamplingParams(max_tokens=12, ignore_eos=True, **how)]


THINKING = thinking_params(False)[:2] + thinking_params(True, temperature=1.0, seed=5)[2:3]  # PROMPTS', for mixes


def test_the_thought_mask_is_the_grammars_at_every_position_of_the_thought(engines):
    """A thought's mask is the grammar's at each of its positions (random allowed tokens in between), None before a
    model-opened thought and after ``</think>``; a reply that opens with other text has no thought."""
    llm, rng = engines["ar"], random.Random(3)
    grammars, V = llm.engine.grammars, llm.config.vocab_size
    for opened in (False, True):
        state = grammars.start(after_reasoning(GRAMMAR, THINK, THINK_END, opened))
        if not opened:
            assert state.thought_mask(V) is None
            state.accept(THINK)
        mask = state.thought_mask(V)
        inside = [t for t in range(V) if mask[t // 32] >> (t % 32) & 1 and t != THINK_END]
        assert THINK not in inside and not set(llm.engine.eos_token_ids) & set(inside) and len(inside) > V // 2
        for _ in range(40):
            state.accept(rng.choice(inside))
            assert torch.equal(next_token_masks([state], V)[0], mask) and state.thought_mask(V) is mask
        state.accept(THINK_END)
        assert state.thought_mask(V) is None and state.thought is None
    state = grammars.start(after_reasoning(GRAMMAR, THINK, THINK_END, False))
    state.accept(llm.tokenizer.encode("{")[0])
    assert state.thought is None and state.thought_mask(V) is None


@pytest.mark.parametrize("opened", [False, True], ids=["model-opened", "prompt-opened"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_free_thought_steps_unmasked_and_emits_what_its_masks_would(engines, opened, sampled, monkeypatch):
    """A grammar after a free thought: inside the thought the sequence steps as a plain one (graphed on a GPU, its
    thought's mask sent once, its steps pipelined), its step accepting nothing after ``</think>`` and the one launched
    before the host saw that end emitting nothing, then with masks made each step again.
    AR, chain and DDTree (an oracle's drafts: ``</think>`` accepted mid-path, the tokens after it dropped) emit what
    masking every step emits, with the same log-probabilities."""
    how = dict(temperature=1.0, seed=7) if sampled else {}
    params = [dataclasses.replace(p, logprobs=2) for p in thinking_params(opened, **how)]
    with monkeypatch.context() as m:
        m.setattr(GrammarState, "thought_mask", lambda self, vocab: None)
        masked_outs = generate(engines["ar"], params)
    assert all(THINK_END in c.token_ids for c in masked_outs[:-1]) and any(c.finish_reason == "stop"
                                                                           for c in masked_outs[:-1])
    assert max(c.token_ids.index(THINK_END) for c in masked_outs[:-1]) > 8  # a thought of several steps
    for spec, drafts in [("ar", None), ("chain", "oracle"), ("ddtree", "oracle")] + (
            [] if sampled else [("ddtree", "random")]):
        llm = engines[spec]
        if drafts == "oracle":
            oracle(llm, {tuple(p): p + c.token_ids for p, c in zip(PROMPTS + [PLAIN], masked_outs)})
        steps, results = [], []
        launch = llm.engine.runner.launch

        def recorded(prefill, step):
            launched = launch(prefill, step)
            steps.append(step)
            results.append(launched[1])
            return launched

        monkeypatch.setattr(llm.engine.runner, "launch", recorded)
        outs = generate(llm, params)
        monkeypatch.undo()
        llm.engine.runner.__dict__.pop("draft", None)
        for c, want in zip(outs, masked_outs):
            assert c.token_ids == want.token_ids, (spec, drafts)
            assert chosen_logprobs(c) == pytest.approx(chosen_logprobs(want), abs=1e-4), (spec, drafts)
        steps = [s for s in steps if s is not None]
        began = [slot for s in steps for slot, (end, _) in s.thoughts.items() if end == THINK_END]
        ended = [slot for s in steps for slot, (end, _) in s.thoughts.items() if end == -1]
        assert len(began) == len(ended) == 3, (spec, drafts)  # each thought stepped unmasked, then masked again
        unmasked = [s for s in steps if s.grammars is None and any(end >= 0 for end, _ in s.thoughts.values())]
        assert unmasked, (spec, drafts)
        # the first thought ends in a pipelined step: the step launched before the host saw it emitted nothing
        assert [] in [t for r in results if r is not None for t in r.result().tokens], (spec, drafts)


@pytest.mark.parametrize("spec,pages", [({"spec": "ar"}, 10),
                                        ({"drafter": "random", "spec": "chain", "block_size": 4}, 10)],
                         ids=["ar", "chain"])
def test_grammar_requests_under_preemption_end_as_with_room(random_k2, spec, pages):
    """Grammar requests (greedy and seeded), a seeded plain one and grammars after free thoughts in a pool too small for
    all of them: preempted (a thought among them, which its slot holds again after its prefill) and prefilled again,
    each ends as with room, and every page comes back. (A grammar step's result is applied before the next launch, so
    a sequence preempted there had nothing in flight and was released at once: later in the same batch, it stepped
    from the waiting queue, its tokens applied to it, its pages lost at its next admission.)"""
    prompts = [p * 8 for p in PROMPTS + [PLAIN] + PROMPTS]

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=MIXED + THINKING)
        return [o.outputs[0].token_ids for o in outs]

    tight = LLM(model=random_k2, num_pages=pages, max_num_seqs=4, prefix_caching=False, **spec)
    assert run(tight) == run(LLM(model=random_k2, **spec))
    assert tight.engine.scheduler.preemptions > 0 and tight.engine.free_pages() == pages


def test_structured_outputs_are_checked_where_they_enter(engines):
    with pytest.raises(ValueError, match="exactly one of json"):
        StructuredOutputsParams(json=SCHEMA, json_object=True)
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=GRAMMAR)
    with pytest.raises(ValueError, match="must be a kdray.StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    with pytest.raises(ValueError, match='structured_outputs: the JSON schema does not compile: Unsupported type "x"'):
        engines["ar"].generate(prompt_token_ids=[PLAIN], sampling_params=SamplingParams(
            structured_outputs=StructuredOutputsParams(json={"type": "x"})))
    with pytest.raises(ValueError, match="structured_outputs: .* the model has no tokenizer"):
        LLM(model="k2-tiny", spec="ar").generate(prompt_token_ids=[PLAIN], sampling_params=SamplingParams(
            structured_outputs=GRAMMAR))


@pytest.mark.parametrize("markers", [True, False], ids=["marker-tokens", "marker-text"])
def test_hermes_forced_call_grammar_takes_its_calls_and_nothing_else(markers):
    """Hermes' format, its markers as tokens or as text: the grammar takes the calls the parser reads back (one
    per line with several), then EOS; another function's call, or text before the call, is refused."""
    names = ({"<tool_call>": 256, "</tool_call>": 257} if markers else {}) | {"<|eos|>": 258}
    tok = Tokenizer(TiktokenBackend({bytes([b]): b for b in range(256)}, names), eos_token_ids=(258,))
    parser = ToolCallParser(tok)
    grammars = Grammars(tok, 260, (258,))
    functions = [("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}), ("get_time", None)]
    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')

    def takes(text: str, several: bool) -> bool:
        state = grammars.start(StructuredOutputsParams(structural_tag=parser.grammar(functions, several)))
        return all(state.matcher.accept_token(t) for t in tok.encode(text) + [258]) and state.ended

    assert takes(reply, True) and not takes(reply, False)
    assert takes(reply.split("\n<tool_call>")[0], False)
    assert not takes("Sure. " + reply, True)
    assert not takes(reply.replace("get_time", "get_date"), True)
    calls = parser.parse(ToolText(parser).text(tok.encode(reply), True), True).calls
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "rain": {"type": "boolean"}},
        "required": ["city", "rain"]}


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_response_format_json_schema_and_json_object(serving, route):
    """The scripted model would greet; under a schema its reply parses and follows it (with ``strict``, no other
    properties), streamed and not; under json_object it is a JSON object."""
    body = {"messages": USER} if route == "chat" else {"prompt": "<|im_assistant|>assistant<|im_middle|>"}
    schema = {"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY, "strict": True}}
    for seed in range(3):
        whole = call(serving, route, {**body, "max_tokens": 40, "seed": seed, "response_format": schema})
        choice = whole["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
        assert choice["finish_reason"] == "stop" and set(json.loads(text)) == {"city", "rain"}
        jsonschema.validate(json.loads(text), CITY)
        chunks = call(serving, route, {**body, "max_tokens": 40, "seed": seed, "response_format": schema,
                                       "stream": True})
        pieces = [c["choices"][0]["delta"].get("content") or "" if route == "chat" else c["choices"][0]["text"]
                  for c in chunks]
        assert "".join(pieces) == text
    free = call(serving, route, {**body, "max_tokens": 40})
    assert not (free["choices"][0].get("message") or free["choices"][0])["content" if route == "chat" else "text"
                                                                         ].startswith("{")
    obj = call(serving, route, {**body, "max_tokens": 4, "seed": 1, "response_format": {"type": "json_object"}})
    choice = obj["choices"][0]
    assert (choice["message"]["content"] if route == "chat" else choice["text"]).startswith("{")


def names(reply: dict) -> list[str]:
    return [t["function"]["name"] for t in reply["choices"][0]["message"].get("tool_calls") or []]


def test_tool_choice_forces_calls_in_k2s_format(serving):
    """The scripted model calls get_weather, then get_time; named, only get_time is called; after the tool results
    it would answer in text, and "required" makes it call instead. Streamed deltas add up to the same call."""
    auto = call(serving, "chat", {"messages": USER, "tools": TOOLS})
    assert names(auto) == ["get_weather", "get_time"]
    named = {"type": "function", "function": {"name": "get_time"}}
    forced = call(serving, "chat", {"messages": USER, "tools": TOOLS, "tool_choice": named})
    assert forced["choices"][0]["finish_reason"] == "tool_calls" and names(forced) == ["get_time"]
    arguments = forced["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"timezone": "Europe/Paris"}
    chunks = call(serving, "chat", {"messages": USER, "tools": TOOLS, "tool_choice": named, "stream": True})
    deltas = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_time"
    assert "".join(t["function"]["arguments"] for t in deltas) == arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    message = auto["choices"][0]["message"]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
               *[{"role": "tool", "tool_call_id": t["id"], "content": "12°C"} for t in message["tool_calls"]]]
    answer = call(serving, "chat", {"messages": history, "tools": TOOLS})
    assert names(answer) == [] and answer["choices"][0]["finish_reason"] == "stop"
    required = call(serving, "chat", {"messages": history, "tools": TOOLS, "tool_choice": "required"})
    assert required["choices"][0]["finish_reason"] == "tool_calls" and required["choices"][0]["message"]["content"] \
        is None and set(names(required)) <= {"get_weather", "get_time"} and names(required)


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nonsense"}}}},
     "response_format", 'the JSON schema does not compile: Unsupported type "nonsense"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice", "the tools' parameters as a grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice",
     "names function 'get_date', which tools do not declare"),
])
def test_grammars_that_do_not_compile_or_name_nothing_are_400s(serving, fields, param, message):
    with pytest.raises(APIError, match=message) as e:
        call(serving, "chat", {"messages": USER, **fields})
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.gpu
def test_grammar_steps_on_the_gpu_equal_the_cpu_reference(random_k2):
    """fp32 on the GPU with CUDA graphs: DDTree's grammar batches (stepped eagerly, their masks uploaded between the
    halves), the plain request beside them and grammars after free thoughts (the thoughts stepped from graphs) emit
    the CPU AR's tokens."""
    pytest.importorskip("xgrammar", reason="kdray's grammar backend (a dependency) is not in this GPU image")
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    grammars = [SamplingParams(max_tokens=48, structured_outputs=GRAMMAR)] * len(PROMPTS)
    # (apart: a grammar request beside a thought makes the batch eager)
    batches = [(PROMPTS + [PLAIN], grammars + [plain]), (PROMPTS + [PLAIN], THINKING + [plain])]
    cpu = LLM(model=random_k2, device="cpu", spec="ar")
    gpu = LLM(model=random_k2, device="cuda", dtype="float32", drafter="random", spec="ddtree", budget=16,
              block_size=8, cuda_graphs=True)
    for prompts, params in batches:
        want = cpu.generate(prompt_token_ids=prompts, sampling_params=params)
        outs = gpu.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert any("thought" in dict(options)["extras"] for options, _ in gpu.engine.runner._step_graphs._captures)
