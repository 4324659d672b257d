"""Constrained decoding (``structured_outputs``): a grammar's token mask on the target's choice, the same for plain
decoding and for every verified tree node.

A request's grammar (a JSON schema, any JSON object, or an xgrammar structural tag, which forced tool calls use) is
compiled by :class:`Grammars` (xgrammar caches compiled grammars), and the request's :class:`GrammarState` follows
its committed output. Before a step's tree is verified, :func:`tree_masks` walks each grammar row's tree
depth-first from the committed state (consume a node's token, fill the mask of what may follow, roll back), so a
node's mask is the one plain decoding applies after that node's path and chain and DDTree stay lossless; a prompt's
first token takes :func:`next_token_masks`. The masks are made on the engine's host (its matchers are the only
ones), as one bitmask ``[R, ceil(V/32)]`` int32 that goes to the device (on Ray, to every shard); :func:`masked` sets
the logits they exclude to -inf. Inside the free thought that :func:`after_reasoning` puts before a grammar, the mask
is the same at every position until the thought's end marker: the engine sends it to the runner's slot once, and the
request steps as a plain one there (graphed, nothing made on the host), its step accepting nothing after the end
marker, which becomes its bonus token (:meth:`GrammarState.thought_mask`).

The matcher reads each token id's bytes (:func:`token_bytes`): a special token is the byte 0xFF (never in UTF-8
text) and its name, so no text matches it and a grammar names it by its id; ids past the tokenizer's vocabulary
are empty, never allowed. xgrammar is imported on first use (it takes a second).
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import torch

from kdray.kernels.tree_build import DraftTree
from kdray.model.tokenizer import TiktokenBackend, Tokenizer
from kdray.spec.structured_outputs import StructuredOutputsParams

SPECIAL_LEAD = b"\xff"  # before a special token's name: no UTF-8 text holds this byte
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?")  # "[time] file.cc:12: "
# xgrammar 0.2 writes a string with minLength or maxLength as a bounded repetition of this one rule, which lets raw
# control characters in (invalid JSON: a tab, a \x02; mlc-ai/xgrammar#800); kdray leaves them out. (The rule has no
# escapes either; with them as alternatives a mask took ~20 ms at K2's vocabulary instead of ~0.1.)
_BOUNDED_CHAR = re.compile(r'^(\S+ ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r'(([^\0-\x1f\"\\]))'


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes as decoding writes them, ``vocab_size`` entries: special tokens as SPECIAL_LEAD and their name,
    ids the tokenizer lacks empty. Tiktoken vocabularies and byte-level BPE (``tokenizer.json``, GGUF) are read."""
    backend, out = tokenizer.backend, [b""] * vocab_size
    if isinstance(backend, TiktokenBackend):
        for i in range(min(backend.num_ranks, vocab_size)):
            out[i] = backend.enc.decode_single_token_bytes(i)
        specials = backend.specials
    else:
        import tokenizers

        tok = backend.tok
        if not isinstance(tok.decoder, tokenizers.decoders.ByteLevel):
            raise ValueError(f"this tokenizer's decoder ({type(tok.decoder).__name__}) is not byte-level, so kdray "
                             "cannot tell each token's bytes; grammars need a byte-level BPE or tiktoken vocabulary")
        chars = byte_level_alphabet()
        for text, i in tok.get_vocab(with_added_tokens=False).items():
            if i < vocab_size:
                out[i] = bytes(chars[c] for c in text) if all(c in chars for c in text) else text.encode()
        added = tok.get_added_tokens_decoder()
        specials = {t.content: i for i, t in added.items() if t.special}
        for i, t in added.items():
            if not t.special and i < vocab_size:
                out[i] = t.content.encode()
    for name, i in specials.items():
        if i < vocab_size:
            out[i] = SPECIAL_LEAD + name.encode()
    return out


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


class Grammars:
    """Grammars for one model: its token table (built on first use; about a second at 163840 tokens), compiled
    grammars and matchers. Thread-safe. ``refusal`` (or no tokenizer) says why this engine cannot constrain
    decoding: every compile raises it."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: tuple[int, ...],
                 refusal: str | None = None):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        if refusal is None and tokenizer is None:
            refusal = "the model has no tokenizer, so a grammar has no token text to match"
        if refusal is None and not self.eos_ids:
            refusal = "the model names no EOS token, so a grammar's output cannot end"
        self.refusal = refusal
        self._compiler = None
        self._lock = threading.Lock()

    def compiler(self):
        """The xgrammar compiler of this vocabulary (made on first use)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo(token_bytes(self.tokenizer, self.vocab_size), xgr.VocabType.RAW,
                                         vocab_size=self.vocab_size, stop_token_ids=list(self.eos_ids))
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """``params``' grammar, compiled (cached after the first time); a ValueError says why it does not compile."""
        if self.refusal is not None:
            raise ValueError(f"constrained decoding is not available here: {self.refusal}")
        compiler = self.compiler()
        if params.json_object:
            return compiler.compile_grammar(json_object_grammar())
        try:
            if params.json is not None:
                return compiler.compile_grammar(json_schema_grammar(params))
            return compiler.compile_structural_tag(params.structural_tag)
        except (RuntimeError, ValueError) as e:  # xgrammar's errors carry a source location first
            what = {"json": "JSON schema", "structural_tag": "structural tag"}
            reason = _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise ValueError(f"the {what[params.field]} does not compile: {reason}") from None

    def start(self, params: StructuredOutputsParams) -> GrammarState:
        """A matcher of ``params``' grammar at the output's start."""
        import xgrammar as xgr

        thought = params.thought if isinstance(params, AfterThought) else None
        return GrammarState(xgr.GrammarMatcher(self.compile(params)), thought)


@dataclass(frozen=True)
class Thought:
    """The free thought a grammar opens with: its markers' ids, and whether the prompt opened it."""

    think: int
    end: int
    opened: bool


@dataclass
class AfterThought(StructuredOutputsParams):
    """A grammar after a free thought, as :func:`after_reasoning` makes it: a structural tag, and the thought's
    markers, by which the engine steps the thought as a plain request under its one mask
    (:meth:`GrammarState.thought_mask`)."""

    thought: Thought | None = None


def after_reasoning(params: StructuredOutputsParams, think: int, think_end: int, opened: bool,
                    held: tuple[int, ...] = ()) -> AfterThought:
    """``params``' grammar (one that compiles) after a thought: an optional ``think ... think_end`` (``opened``: the
    prompt opened it, so its rest and ``think_end``, required), any tokens inside but the two markers and ``held``
    (tokens that would end the thought without its marker: they wait for the grammar), as one structural tag."""
    import xgrammar as xgr

    if params.json is not None:
        answer = {"type": "grammar", "grammar": json_schema_grammar(params)}
    elif params.json_object:
        answer = {"type": "grammar", "grammar": json_object_grammar()}
    else:
        answer = json.loads(params.structural_tag)["format"]
    thought = [{"type": "any_tokens", "exclude_tokens": [think, think_end, *held]},
               {"type": "token", "token": think_end}]
    if opened:
        prefix = {"type": "sequence", "elements": thought}
    else:
        prefix = {"type": "optional", "content": {"type": "sequence",
                                                  "elements": [{"type": "token", "token": think}, *thought]}}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [prefix, answer]}}
    return AfterThought(structural_tag=json.dumps(tag), thought=Thought(think, think_end, opened))


def json_schema_grammar(params: StructuredOutputsParams) -> str:
    """A ``json`` grammar as xgrammar EBNF: xgrammar's conversion of the schema, with kdray's options (one line, ", "
    and ": "; strict where ``disable_additional_properties`` asks), no raw control character in a length-bounded
    string (:data:`_BOUNDED_CHAR`)."""
    import xgrammar as xgr

    schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                            strict_mode=params.disable_additional_properties))
    return _BOUNDED_CHAR.sub(lambda m: m.group(1) + _JSON_CHAR, text)


def json_object_grammar() -> str:
    """xgrammar's built-in JSON grammar (fast masks), its root narrowed from an object or array to an object."""
    import xgrammar as xgr

    root, rules = str(xgr.Grammar.builtin_json_grammar()).split("\n", 1)
    if not root.startswith("root ::=") or "\nmembers_and_embrace ::=" not in "\n" + rules:
        raise RuntimeError(f"xgrammar's built-in JSON grammar changed shape (root: {root[:80]}); update "
                           "kdray.spec.grammar.json_object_grammar for this xgrammar version")
    return 'root ::= "{" [ \\n\\r\\t]* members_and_embrace\n' + rules


class GrammarState:
    """One request's matcher, advanced by the engine on each committed token, and where its grammar opens with a free
    thought (:class:`Thought`), whether the output is inside it."""

    def __init__(self, matcher, thought: Thought | None = None):
        self.matcher = matcher
        self.thought = thought  # None once the output is past the thought, or has none
        self.thinking = thought is not None and thought.opened
        self._mask: torch.Tensor | None = None  # inside the thought: its mask

    def accept(self, token: int):
        """Consume a committed token (the masks allowed only tokens it accepts)."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} was committed against its grammar's mask; this is a bug in kdray")
        if self.thought is not None:
            opens = not self.thinking and token == self.thought.think  # (the first token: it is None after it)
            self.thinking = opens or self.thinking and token != self.thought.end
            if not self.thinking:
                self.thought = None

    @property
    def ended(self) -> bool:
        """The grammar accepted its end (an EOS after a complete output)."""
        return self.matcher.is_terminated()

    def thought_mask(self, vocab: int) -> torch.Tensor | None:
        """Inside the free thought: the tokens the grammar allows there ``[ceil(vocab/32)]`` int32 on the host, the
        same at every position until the thought's end marker (which it allows); None elsewhere."""
        if not self.thinking:
            return None
        if self._mask is None:
            self._mask = next_token_masks([self], vocab)[0]
        return self._mask


def tree_masks(states: list[GrammarState | None], tree: DraftTree, vocab: int) -> torch.Tensor:
    """``[B * (1+N), ceil(vocab/32)]`` int32 on the host, one row per node of ``tree`` (rows of ``states[b]``'s tree
    first): the tokens plain decoding may choose after the node's path, from the committed state (whose last token
    is the root). Rows of sequences without a grammar, unused nodes and nodes no allowed path reaches (never accepted:
    their token is masked at their parent) allow every token."""
    B, width = tree.tokens.shape
    tokens, parents, counts = tree.tokens.cpu(), tree.parents.cpu(), tree.num_nodes.tolist()
    out = torch.full((B * width, (vocab + 31) // 32), -1, dtype=torch.int32)  # [B * (1+N), W]
    for b, state in enumerate(states):
        if state is None:
            continue
        n = counts[b]
        first, after = _first_child_next_sibling(parents[b, :n].tolist())
        state.matcher.traverse_draft_tree(first, after, tokens[b, :n], out[b * width:b * width + n])
    out[(out == 0).all(1)] = -1  # unreachable nodes, and nodes past the grammar's end: never accepted
    return out


def next_token_masks(states: list[GrammarState | None], vocab: int) -> torch.Tensor:
    """``[B, ceil(vocab/32)]`` int32 on the host: per sequence the tokens its grammar allows next (every token without
    one): :func:`tree_masks` of one-node trees."""
    B = len(states)
    roots = DraftTree(tokens=torch.zeros(B, 1, dtype=torch.int64), parents=torch.full((B, 1), -1, dtype=torch.int32),
                      depths=None, num_nodes=torch.ones(B, dtype=torch.int32), mask=None)
    return tree_masks(states, roots, vocab)


def _first_child_next_sibling(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree as xgrammar walks it: per node its first child and its next sibling (-1: none). ``[n]`` int64 each."""
    first, after = [-1] * len(parents), [-1] * len(parents)
    for i in range(len(parents) - 1, 0, -1):
        after[i], first[parents[i]] = first[parents[i]], i
    return torch.tensor(first), torch.tensor(after)


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits ``[R, V]`` with the tokens ``bitmask [R, ceil(V/32)]`` int32 leaves out set to -inf (a new tensor). Token
    t is bit t % 32 of word t // 32, so byte by byte (little-endian) it is bit t % 8 of byte t // 8."""
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((bitmask.view(torch.uint8)[:, :, None] >> shifts) & 1).flatten(1)[:, :logits.shape[1]]  # [R, V] uint8
    return logits.masked_fill(allowed == 0, float("-inf"))
