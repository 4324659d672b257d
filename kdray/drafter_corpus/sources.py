"""Prompt sources reachable offline: seeds (a passage or a topic, with the fields its templates need) read from
Python's reference topics, the docstrings of installed packages (parsed with ``ast``, nothing imported), manual
pages, FOLDOC's computing dictionary and a word list. Each seed names its source document (``doc``): the unit
that the held-out split keeps whole."""
from __future__ import annotations

import ast
import gzip
import importlib.metadata
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MIN_DOC_CHARS = 80  # shorter docstrings and manual descriptions say too little to ask about
MAX_FILE_BYTES = 1 << 20  # larger .py files are generated tables, not documented code
SKIP_DIRS = {"test", "tests", "testing", "_vendor", "vendor", "vendored", "_vendored", "site-packages"}


@dataclass
class Seed:
    """One passage or topic: ``fields`` fill its kind's templates; ``fields["text"]`` is what deduplication
    compares."""

    source: str
    doc: str  # source document, e.g. "docstrings:numpy", "man:git", "pydoc:assert"
    kind: str  # picks the templates: pydoc, module, function, class, command, cfunction, topic, term, word, math
    fields: dict[str, str] = field(default_factory=dict)


class MissingSource(Exception):
    """A source whose files are absent on this machine (the message says which and how to install them)."""


def passages(text: str, max_chars: int) -> list[str]:
    """``text`` cut into passages of at most ``max_chars``: whole paragraphs where they fit, each at least a
    quarter of ``max_chars`` before a new one starts."""
    out, chunk = [], ""
    for para in (p.strip() for p in text.split("\n\n") if p.strip()):
        if len(chunk) >= max_chars // 4 and len(chunk) + len(para) + 2 > max_chars:
            out.append(chunk)
            chunk = ""
        chunk = f"{chunk}\n\n{para}".strip()[:max_chars]
    return out + [chunk] if chunk else out


# ---------------------------------------------------------------- Python


def pydoc_seeds(max_chars: int) -> Iterator[Seed]:
    """Passages of the Python language reference (``pydoc_data.topics``), one document per topic."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        for text in passages(topics[name], max_chars):
            yield Seed("pydoc", f"pydoc:{name}", "pydoc", {"text": text})


def python_files(packages: list[str] | None) -> Iterator[tuple[str, Path, Path]]:
    """(distribution, .py file, its path under the install root) of the standard library (as ``python``) and
    every installed distribution (or only ``packages``), tests and vendored copies left out, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dists: dict[str, importlib.metadata.Distribution | None] = {"python": None}  # None: the standard library
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"]
        if name and name not in dists:
            dists[name] = d
    wanted = set(dists) if packages is None else set(packages)
    unknown = wanted - set(dists)
    if unknown:
        raise ValueError(f"--packages: {', '.join(sorted(unknown))} not installed (installed: python and "
                         f"{len(dists) - 1} distributions; `pip list` names them)")
    for name in sorted(wanted, key=str.lower):  # only the wanted ones are listed (the standard library is ~1 s)
        d = dists[name]
        files = (sorted((p, p.relative_to(stdlib)) for p in stdlib.rglob("*.py")) if d is None else
                 sorted((Path(d.locate_file(f)), Path(f)) for f in d.files or [] if f.suffix == ".py"))
        for path, rel in files:
            if not SKIP_DIRS & set(rel.parts[:-1]) and not rel.name.startswith("test_") and rel.parts[0] != "..":
                yield name, path, rel


def docstring_seeds(max_chars: int, packages: list[str] | None = None) -> Iterator[Seed]:
    """Module, public class and public function docstrings of installed Python code, one document per
    top-level package of a distribution (``docstrings:python/json``, ``docstrings:numpy/numpy``); source files
    are parsed, never imported."""
    for dist, path, rel in python_files(packages):
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            tree = ast.parse(path.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        doc = f"docstrings:{dist}/{rel.parts[0].removesuffix('.py')}"
        text = ast.get_docstring(tree)
        if text and len(text) >= MIN_DOC_CHARS:
            yield Seed("docstrings", doc, "module", {"package": dist, "name": module,
                                                     "text": passages(text, max_chars)[0]})
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name[0] == "_":
                continue
            text = ast.get_docstring(node)
            if not text or len(text) < MIN_DOC_CHARS:
                continue
            fields = {"package": dist, "name": f"{module}.{node.name}", "text": passages(text, max_chars)[0]}
            if isinstance(node, ast.ClassDef):
                yield Seed("docstrings", doc, "class", fields)
            else:
                args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                        if a.arg not in ("self", "cls")]
                yield Seed("docstrings", doc, "function", {**fields, "signature": f"{node.name}({', '.join(args)})"})


# ---------------------------------------------------------------- Debian text packages

TROFF_ESCAPES = [
    (re.compile(r"\\f(\(..|\[[^]]*]|.)"), ""),  # font changes
    (re.compile(r"\\\*(\(..|\[[^]]*]|.)"), ""),  # predefined strings
    (re.compile(r"\\s[-+]?\d+"), ""),  # size changes
    (re.compile(r"\\[hvwlLoDxXNbZ]'[^']*'"), ""),  # motions and drawing
    (re.compile(r"\\\((em|en)"), "-"), (re.compile(r"\\\((aq|cq|oq)"), "'"), (re.compile(r"\\\((lq|rq)"), '"'),
    (re.compile(r"\\\(..|\\\[[^]]*]"), ""),  # other special characters
    (re.compile(r"\\[-e&|^%]"), lambda m: {"\\-": "-", "\\e": "\\"}.get(m.group(0), "")),
    (re.compile(r"\\(.)"), r"\1"),
]
PARAGRAPH_MACROS = {"PP", "P", "LP", "TP", "IP", "HP", "sp", "br", "SS", "Sh", "Pp", "It"}


def troff_sections(source: str) -> dict[str, str]:
    """The plain text of a man page's sections (``NAME``, ``DESCRIPTION``, ...) from its troff (man or mdoc
    macros): macros that carry text keep it, the rest break paragraphs or vanish."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"")) or line.startswith('\\"'):
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line[1:].strip().partition(" ")
            if macro in ("SH", "Sh"):
                current = rest.strip().strip('"').upper()
                sections[current] = []
                continue
            if macro in PARAGRAPH_MACROS:
                line = "\n" + (rest if macro in ("SS", "It", "IP") else "")
            elif macro in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "SB", "Nm", "Nd", "Ar", "Fl", "Xr",
                           "Dq", "Sq", "Ql", "Em", "Pa", "Fn", "Cm", "Va", "Ev"):
                line = rest.replace('"', "")
            else:
                continue
        if current is not None:
            for pattern, repl in TROFF_ESCAPES:
                line = pattern.sub(repl, line)
            sections[current].append(line)
    return {k: re.sub(r"[ \t]+", " ", re.sub(r"\n{3,}", "\n\n", "\n".join(v))).strip() for k, v in sections.items()}


MAN_KINDS = {"1": "command", "6": "command", "8": "command", "2": "cfunction", "3": "cfunction", "4": "topic",
             "5": "topic", "7": "topic"}


def man_seeds(man_dir: Path, max_chars: int) -> Iterator[Seed]:
    """One seed per English manual page (``man_dir/man<N>/*.gz``) with a NAME line and a DESCRIPTION: its
    summary and the start of its description; one document per family (``git-commit`` and ``git-log`` are
    ``man:git``)."""
    pages = sorted(man_dir.glob("man[1-8]/*.gz"))
    if not pages:
        raise MissingSource(f"no manual pages under {man_dir}/man[1-8] (install man-db and manpages: "
                            "scripts/corpus_sources.sh; slim images may exclude /usr/share/man in dpkg's config)")
    for path in pages:
        try:
            text = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
        except (OSError, EOFError):
            continue
        if text.lstrip().startswith(".so "):  # a link to another page
            continue
        sec = troff_sections(text)
        name_line = " ".join(sec.get("NAME", "").split())
        names, sep, summary = name_line.partition(" - ")
        description = sec.get("DESCRIPTION", "")
        if not sep or len(description) < MIN_DOC_CHARS:
            continue
        name = names.split(",")[0].strip()
        section = path.parent.name[3:]
        family = re.split(r"[-_.:\s]", name)[0] or name
        yield Seed("man", f"man:{family}", MAN_KINDS[section], {"name": name, "summary": summary.strip().rstrip("."),
                                                               "text": passages(description, max_chars)[0]})


DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(s: str) -> int:
    """A dictd index offset or length (base 64, most significant digit first)."""
    n = 0
    for c in s:
        n = n * 64 + DICTD_DIGITS.index(c)
    return n


def foldoc_seeds(path: Path, max_chars: int) -> Iterator[Seed]:
    """One seed per FOLDOC entry (dictd's ``<path>.index`` and ``<path>.dict.dz``): the term and its definition
    with the cross-reference braces and subject tags removed; one document per term."""
    index, data = path.with_suffix(".index"), path.with_suffix(".dict.dz")
    if not index.is_file() or not data.is_file():
        raise MissingSource(f"{index} or {data} not found (apt-get install dict-foldoc: scripts/corpus_sources.sh)")
    body = gzip.decompress(data.read_bytes())  # dictzip is gzip
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        term, offset, length = line.split("\t")
        if term.startswith("00database"):
            continue
        start = dictd_number(offset)
        entry = body[start:start + dictd_number(length)].decode("utf-8", "replace")
        head, _, definition = entry.partition("\n\n")
        definition = re.sub(r"<[^>\n]*>|\{|\}|\(\d{4}-\d\d-\d\d\)", "", definition)
        definition = "\n\n".join(" ".join(p.split()) for p in definition.split("\n\n") if p.strip())
        if definition.startswith("See ") or len(definition) < MIN_DOC_CHARS:
            continue
        title = head.splitlines()[0].strip()
        yield Seed("foldoc", f"foldoc:{term}", "term", {"term": title, "text": passages(definition, max_chars)[0]})


def word_seeds(path: Path) -> Iterator[Seed]:
    """One seed per common-looking word of a word list (lowercase letters only, 4 to 12 of them); one document
    per word."""
    if not path.is_file():
        raise MissingSource(f"{path} not found (apt-get install wamerican: scripts/corpus_sources.sh)")
    words = sorted({w for w in path.read_text(encoding="utf-8", errors="replace").split()
                    if w.isascii() and w.isalpha() and w.islower() and 4 <= len(w) <= 12})
    for w in words:
        yield Seed("words", f"words:{w}", "word", {"word": w, "text": w})
