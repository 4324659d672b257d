"""Text <-> token ids for a checkpoint, with its chat template, end-of-sequence ids and incremental decoding.

Two backends sit behind one ``Tokenizer``: ``tokenizers`` (``tokenizer.json`` or a GGUF vocabulary) and
tiktoken (Kimi-K2's ``tiktoken.model``). Both encode special tokens written in the text as their ids (what
transformers does with a rendered chat prompt; user text is not escaped) and decode with special tokens skipped.
Both encode the text between two special tokens on its own, so ``Tokenizer`` caches the ids of long pieces: a
system prompt shared by many chat requests is encoded once.
"""
from __future__ import annotations

import base64
import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Kimi-K2's pre-tokenizer (``pat_str`` of Moonshot's tokenization_kimi.py), in the regex dialect tiktoken reads
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # letters that may start a word (Han excluded)
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",  # a run of Han characters
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTION,  # a word, after one mark or space
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTION,  # an upper-case word
    r"\p{N}{1,3}",  # up to three digits
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # punctuation, with the line breaks after it
    r"\s*[\r\n]+",
    r"\s+(?!\S)",  # spaces, but not the one before a word
    r"\s+",
])
KIMI_SPECIAL_IDS = 256  # special ids follow the BPE ranks: n .. n+255, unnamed ones "<|reserved_token_{id}|>"
# Kimi's tokenizer hands tiktoken at most 400k characters at a time, cut further inside any run of whitespace or
# of non-whitespace longer than 25k characters (BPE is quadratic in a piece's length).
TIKTOKEN_MAX_CHARS, TIKTOKEN_MAX_RUN = 400_000, 25_000
_RUN = re.compile(r"\s+|\S+")
CACHED_PIECE_CHARS = 1024  # text between special tokens at least this long is encoded once and cached
PIECE_CACHE_SIZE = 64  # such pieces kept (least recently used dropped)


@lru_cache(maxsize=PIECE_CACHE_SIZE)
def cached_piece_ids(backend: "TokenizersBackend | TiktokenBackend", piece: str) -> tuple[int, ...]:
    """``backend``'s ids of a long piece of text between special tokens, kept for the next request that holds it."""
    return tuple(backend.encode(piece))


def _special_pattern(tokens: list[str]) -> re.Pattern | None:
    """A regex matching ``tokens`` leftmost-longest (as the backends split text at them); None when there are none."""
    return re.compile("|".join(map(re.escape, sorted(set(tokens), key=len, reverse=True)))) if tokens else None


class TokenizersBackend:
    """A ``tokenizers.Tokenizer`` behind the backend interface: ids <-> text, special token <-> id."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok
        added = list(tok.get_added_tokens_decoder().values())
        # An added token that strips whitespace beside it, or is matched in normalised text (a second pass), ties
        # its neighbours' ids to it: then the text is never cut.
        plain = not any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added)
        self._specials = _special_pattern([t.content for t in added]) if plain else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def special_cuts(self, text: str) -> re.Pattern | None:
        """The added tokens, as a regex, where ``text`` may be cut into pieces encoded alone with the same ids
        (tokenizers splits at added tokens before it normalises and pre-tokenizes); None where it may not."""
        return self._specials

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def get_added_tokens_decoder(self) -> dict[int, tokenizers.AddedToken]:
        return self.tok.get_added_tokens_decoder()


class TiktokenBackend:
    """A tiktoken BPE with a block of special ids after its ranks (Kimi-K2's layout), same interface."""

    def __init__(self, ranks: dict[bytes, int], specials: dict[str, int], pattern: str = KIMI_PATTERN,
                 name: str = "tiktoken"):
        import tiktoken

        self.num_ranks, self.specials = len(ranks), specials
        self.enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        # tiktoken finds special tokens in no particular order: cut only where no special token contains another
        nested = any(a != b and a in b for a in specials for b in specials)
        self._specials = None if nested else _special_pattern(list(specials))

    @classmethod
    def from_files(cls, model: Path, added_tokens: dict[int, str]) -> "TiktokenBackend":
        """``tiktoken.model`` with the special tokens ``added_tokens`` names ({id: token}) as K2 numbers them."""
        ranks = read_tiktoken_ranks(model)
        n = len(ranks)
        inside = sorted(i for i in added_tokens if i < n)
        if inside:
            raise ValueError(f"{model.parent / 'tokenizer_config.json'}: added_tokens_decoder ids {inside[:4]} fall "
                             f"inside the {n} BPE ranks of {model.name}; the two files are from different "
                             "checkpoints, copy both from the same one")
        end = max([n + KIMI_SPECIAL_IDS, *(i + 1 for i in added_tokens)])
        specials = {added_tokens.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, end)}
        if len(specials) < end - n:
            raise ValueError(f"{model.parent / 'tokenizer_config.json'}: added_tokens_decoder names a token twice; "
                             "copy the file from the checkpoint again")
        return cls(ranks, specials, name=model.name)

    def encode(self, text: str) -> list[int]:
        return [i for piece in tiktoken_chunks(text) for i in self.enc.encode(piece, allowed_special="all")]

    def special_cuts(self, text: str) -> re.Pattern | None:
        """The special tokens, as a regex, where ``text`` may be cut into pieces encoded alone with the same ids:
        tiktoken encodes the text between special tokens on its own, as long as ``tiktoken_chunks`` keeps ``text``
        whole (None where it cuts it)."""
        return self._specials if len(tiktoken_chunks(text)) <= 1 else None

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([i for i in ids if 0 <= i < self.num_ranks])  # special (and unknown) ids skipped

    def token_to_id(self, token: str) -> int | None:
        if token in self.specials:
            return self.specials[token]
        try:
            return self.enc.encode_single_token(token.encode())
        except KeyError:
            return None

    def get_added_tokens_decoder(self) -> dict[int, tokenizers.AddedToken]:
        return {i: tokenizers.AddedToken(t, special=True) for t, i in self.specials.items()}


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file (lines ``base64(token bytes) rank``) -> {token bytes: rank}, checked: ranks 0..n-1,
    every single byte a token."""
    fix = f"copy {path.name} from the checkpoint again"
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror}); {fix}") from None
    ranks = {}
    for n, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:  # binascii.Error is one too
            raise ValueError(f"{path}, line {n}: expected 'base64(token bytes) rank', got {line[:60]!r}; {fix}") \
                from None
    if set(ranks.values()) != set(range(len(ranks))):
        raise ValueError(f"{path}: the ranks of {len(ranks)} distinct tokens are not 0..{len(ranks) - 1}; {fix}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: {len(missing)} single bytes (e.g. {bytes(missing[:4])!r}) have no token, so some "
                         f"text cannot be encoded; {fix}")
    return ranks


def tiktoken_chunks(text: str) -> list[str]:
    """``text`` in the pieces Kimi's tokenizer hands tiktoken (see TIKTOKEN_MAX_CHARS)."""
    if len(text) <= TIKTOKEN_MAX_RUN:
        return [text] if text else []
    out = []
    for start in range(0, len(text), TIKTOKEN_MAX_CHARS):
        chunk = text[start:start + TIKTOKEN_MAX_CHARS]
        cuts = [c for m in _RUN.finditer(chunk) for c in range(m.start() + TIKTOKEN_MAX_RUN, m.end(), TIKTOKEN_MAX_RUN)]
        out += [chunk[a:b] for a, b in zip([0, *cuts], [*cuts, len(chunk)])]
    return out


# ---------------------------------------------------------------- chat templates, rendered as transformers does

class ChatTemplateError(ValueError):
    """A chat template that does not compile or fails while rendering; the message says what went wrong."""


class _TemplateRaised(jinja2.TemplateError):
    """A template's own ``raise_exception(message)``."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (no HTML escaping), its options exposed."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks assistant tokens with it)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=[_Generation, jinja2.ext.loopcontrols])
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def render_chat_template(source: str, **context) -> str:
    """``source`` rendered in the sandbox with ``context``; every failure is a ChatTemplateError."""
    try:
        return _compile(source).render(**context)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template: {e.message}") from e
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from e
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template was stopped by the sandbox: {e.message}") from e
    except jinja2.UndefinedError as e:
        raise ChatTemplateError(f"chat template uses something undefined: {e.message}") from e
    except Exception as e:  # noqa: BLE001 - a template is untrusted code; any failure is the template's
        raise ChatTemplateError(f"chat template failed while rendering: {type(e).__name__}: {e}") from e


_CONTINUE = "<kdray:continue-final-message> "  # appended to the final message's text, then cut away with all after it


def _mark_final(message: dict) -> dict:
    """A copy of the final message with _CONTINUE after its text (the last text part of a list content)."""
    if message.get("role") != "assistant":
        raise ValueError(f"continue_final_message: the final message is from '{message.get('role')}', not the "
                         "assistant; only an assistant message can be continued")
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE}
    texts = [i for i, p in enumerate(content or []) if isinstance(p, dict) and isinstance(p.get("text"), str)]
    if not texts:
        raise ValueError("continue_final_message: the final message has no text to continue")
    parts = list(content)
    parts[texts[-1]] = {**parts[texts[-1]], "text": parts[texts[-1]]["text"] + _CONTINUE}
    return {**message, "content": parts}


def _cut_at_mark(text: str) -> str:
    at = text.rfind(_CONTINUE.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not render the final message's "
                                "content, so it cannot be continued")
    # Where the template trimmed the text (the mark's trailing space is gone), trim what stays before it too.
    return text[:at] if text.startswith(_CONTINUE, at) else text[:at].rstrip()


# ---------------------------------------------------------------- the tokenizer

class Tokenizer:
    """A backend (``tokenizers`` or tiktoken) plus what serving needs around it (EOS ids, chat template)."""

    def __init__(self, backend: tokenizers.Tokenizer | TokenizersBackend | TiktokenBackend,
                 eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None,
                 chat_template: str | dict[str, str] | None = None, bos_token: str = "", eos_token: str = ""):
        self.backend = TokenizersBackend(backend) if isinstance(backend, tokenizers.Tokenizer) else backend
        self.eos_token_ids, self.bos_token_id = tuple(eos_token_ids), bos_token_id
        # a template, or {name: template} with a "default" (and a "tool_use" one for requests with tools)
        self.chat_template, self.bos_token, self.eos_token = chat_template, bos_token, eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer | None":
        """The tokenizer saved beside an HF checkpoint: ``tokenizer.json``, else Kimi-K2's ``tiktoken.model``
        (named special tokens from ``tokenizer_config.json``); None when there is neither."""
        path = Path(path)
        conf = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        if (path / "tokenizer.json").is_file():
            try:
                backend = TokenizersBackend(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")))
            except Exception as e:  # noqa: BLE001 - the Rust loader raises a bare Exception
                raise ValueError(f"{path / 'tokenizer.json'}: cannot be loaded ({e}); copy it from the checkpoint "
                                 "again") from None
        elif (path / "tiktoken.model").is_file():
            backend = TiktokenBackend.from_files(path / "tiktoken.model", _added_tokens(path, conf))
        elif conf.get("tokenizer_class") == "TikTokenTokenizer":
            raise ValueError(f"{path / 'tiktoken.model'} is missing, which tokenizer_config.json's TikTokenTokenizer "
                             "reads; copy it from the checkpoint")
        else:
            return None
        token = lambda v: v.get("content", "") if isinstance(v, dict) else (v or "")  # noqa: E731
        eos, bos = token(conf.get("eos_token")), token(conf.get("bos_token"))
        ids = lambda s: () if not s or backend.token_to_id(s) is None else (backend.token_to_id(s),)  # noqa: E731
        return cls(backend, ids(eos), (ids(bos) or (None,))[0], _chat_templates(path, conf), bos, eos)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it become their ids. No BOS is added. The ids of text
        between special tokens of CACHED_PIECE_CHARS or more come from a cache (the same ids: see the module)."""
        cuts = self.backend.special_cuts(text) if len(text) >= CACHED_PIECE_CHARS else None
        if cuts is None:
            return self.backend.encode(text)
        ids, start = [], 0
        for m in cuts.finditer(text):
            ids += self._piece(text[start:m.start()])
            ids.append(self.backend.token_to_id(m.group()))
            start = m.end()
        return ids + self._piece(text[start:])

    def _piece(self, text: str) -> list[int]:
        if len(text) >= CACHED_PIECE_CHARS:
            return list(cached_piece_ids(self.backend, text))
        return self.backend.encode(text) if text else []

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens skipped; half a UTF-8 character decodes as U+FFFD."""
        return self.backend.decode(ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **template_kwargs) -> str:
        """Render chat ``messages`` as transformers does (sandboxed, with its helpers; ``tools``, ``documents``,
        ``add_generation_prompt``, ``bos_token``, ``eos_token`` and ``template_kwargs`` passed in; a message field
        that is None counts as absent). ``add_generation_prompt`` ends with the assistant's header;
        ``continue_final_message`` instead stops right after the final (assistant) message's text, for the model
        to continue it."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API with a plain prompt")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other: continue the "
                             "final message, or start a new assistant turn after it")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if continue_final_message:
            if not messages:
                raise ValueError("continue_final_message: there are no messages to continue")
            messages[-1] = _mark_final(messages[-1])
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **template_kwargs}
        text = render_chat_template(self.template_source(tools), messages=messages, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt, **context)
        return _cut_at_mark(text) if continue_final_message else text

    def template_source(self, tools: list[dict] | None) -> str:
        """The chat template a request renders with (a "tool_use" one, where the checkpoint has it, for tools)."""
        if isinstance(self.chat_template, str):
            return self.chat_template
        name = "tool_use" if tools is not None and "tool_use" in self.chat_template else "default"
        if name not in self.chat_template:
            raise ValueError(f"this model's chat templates are {sorted(self.chat_template)}, none named 'default'; "
                             "add chat_template.jinja to the checkpoint")
        return self.chat_template[name]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e}); copy it from the checkpoint again") from None


def _added_tokens(path: Path, conf: dict) -> dict[int, str]:
    """{id: token} from tokenizer_config.json's ``added_tokens_decoder`` (which a tiktoken.model needs)."""
    source = path / "tokenizer_config.json"
    if "added_tokens_decoder" not in conf:
        raise ValueError(f"{source}: missing or without added_tokens_decoder, which names the special tokens of "
                         f"{path / 'tiktoken.model'}; copy tokenizer_config.json from the checkpoint")
    try:
        return {int(i): t["content"] for i, t in conf["added_tokens_decoder"].items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ValueError(f"{source}: added_tokens_decoder must map ids to {{\"content\": token, ...}}; copy the "
                         "file from the checkpoint again") from None


def _chat_templates(path: Path, conf: dict) -> str | dict[str, str] | None:
    """The checkpoint's chat template(s), as transformers finds them: ``chat_template.jinja`` (and
    ``additional_chat_templates/*.jinja``) over tokenizer_config.json's ``chat_template`` (a string or
    ``[{"name", "template"}]``)."""
    files = {"default": path / "chat_template.jinja",
             **{f.stem: f for f in sorted(path.glob("additional_chat_templates/*.jinja"))}}
    templates = {name: f.read_text(encoding="utf-8") for name, f in files.items() if f.is_file()}
    if not templates:
        found = conf.get("chat_template")
        if not isinstance(found, list):
            return found
        try:
            templates = {t["name"]: t["template"] for t in found}
        except (KeyError, TypeError):
            raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template must be a template or a list of "
                             "{\"name\": ..., \"template\": ...}; copy the file from the checkpoint again") from None
    return templates["default"] if list(templates) == ["default"] else templates


# ---------------------------------------------------------------- incremental detokenization

class IncrementalDetokenizer:
    """The text of a growing sequence of output ids, returned piece by piece (vLLM's prefix/read offsets).

    Each call decodes a window only: up to CONTEXT settled ids (so the next token's leading space, or a character
    split across ids, decodes as in the whole sequence), then the unsettled ids. Text is returned once no later id
    can change it: all but a final U+FFFD, which may be half a UTF-8 character. Ids settle when their text is
    final; after MAX_HELD unsettled ids the settled point moves to the last id whose text is final (a character
    left unfinished across MAX_HELD ids, only possible with special ids inside it, settles as U+FFFD). What ``add``
    and ``flush`` return adds up to ``tokenizer.decode`` of all the output ids (decoded after the prompt).
    """
    CONTEXT = 4
    MAX_HELD = 8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids or [])[-self.CONTEXT:]  # the window: settled context ids, then unsettled ones
        self.read = len(self.ids)  # ids[read:] are unsettled
        self.shown = 0  # characters of the unsettled ids' text already returned

    def add(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; the text that became final ("" while a character is unfinished)."""
        self.ids.extend(new_ids)
        end = len(self.ids)
        text = self._text(end)
        if not text.endswith("\ufffd"):
            return self._emit(text, end, text)
        if end - self.read < self.MAX_HELD:
            return self._emit(text[:-1])
        for j in range(end - 1, self.read, -1):  # held long: settle up to the last id whose text is final
            head = self._text(j)
            if text[:-1].startswith(head):
                return self._emit(text[:-1], j, head)
        return self._emit(text, end, text)

    def flush(self) -> str:
        """The text still held back (an unfinished character's U+FFFD) once the sequence has ended."""
        text = self._text(len(self.ids))
        return self._emit(text, len(self.ids), text)

    def _text(self, end: int) -> str:
        """Text of ``ids[read:end]``, decoded after the context ids."""
        context, text = self.tokenizer.decode(self.ids[:self.read]), self.tokenizer.decode(self.ids[:end])
        return text[len(context):]

    def _emit(self, final: str, settle: int | None = None, settled: str = "") -> str:
        """Return the part of ``final`` (unsettled text no later id changes) not returned yet; then settle
        ``ids[read:settle]`` (whose text is ``settled``), keeping CONTEXT ids before the new read offset."""
        new = final[self.shown:]
        self.shown = len(final)
        if settle is not None:
            self.shown -= len(settled)
            drop = max(settle - self.CONTEXT, 0)
            del self.ids[:drop]
            self.read = settle - drop
        return new
