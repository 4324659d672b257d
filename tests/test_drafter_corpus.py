"""The drafter corpus builder: sources, deduplication, the split by source document, the manifest, determinism,
resumable generation with a tiny target, and train-drafter reading the result."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from kdray.drafter_corpus.cli import main as corpus_main
from kdray.drafter_corpus.dedup import Dedup, normalise
from kdray.drafter_corpus.sources import DICTD_DIGITS, troff_sections

PARAGRAPH = ("The scheduler admits a request when the pages of its prompt fit in the cache, keeps a few pages free "
             "as a watermark, and preempts the most recently admitted request when the pool runs dry; a preempted "
             "request is recomputed later from its prompt and the tokens it had produced, so no request ever fails "
             "for want of memory, and the order in which requests finish stays close to the order they arrived.")

MAN_PAGE = r""".\" a comment
.TH FROB 1
.SH NAME
frob, frobnicate \- adjust the \fBwidgets\fR of a file
.SH SYNOPSIS
.B frob
[\fIOPTION\fR]
.SH DESCRIPTION
.PP
\fBfrob\fP reads each FILE and adjusts its widgets in place\(emquickly. It keeps a backup unless
\fB\-\-no\-backup\fR is given, and reports every widget it changed on standard output.
.TP
\fB\-n\fR
change nothing; print what would change
"""


def dictd_code(n: int) -> str:
    out = ""
    while True:
        out = DICTD_DIGITS[n % 64] + out
        n //= 64
        if not n:
            return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Small stand-ins for the Debian sources: a word list, three man pages, a FOLDOC dictionary."""
    root = tmp_path_factory.mktemp("sources")
    words = root / "words"
    words.write_text("\n".join(["Apple", "apple's", "zebra", "lantern", "copper", "harbor", "violin", "meadow",
                                "pepper", "quartz", "saddle", "tundra", "walrus", "x"]) + "\n")
    for i, name in enumerate(["frob", "frob-extra", "glint"]):
        (root / "man" / "man1").mkdir(parents=True, exist_ok=True)
        page = MAN_PAGE.replace("frob, frobnicate", name).replace("widgets", f"widgets number {i}")
        (root / "man" / "man1" / f"{name}.1.gz").write_bytes(gzip.compress(page.encode()))
    (root / "man" / "man1" / "alias.1.gz").write_bytes(gzip.compress(b".so man1/frob.1\n"))
    entries = [(f"term{i}", f"Term {i}\n\n   <networking> A {['protocol', 'format', 'device', 'language'][i % 4]} "
                f"number {i} that {PARAGRAPH[:120 + 7 * i]}\n\n   (1999-01-0{i % 9 + 1})\n\n") for i in range(12)]
    entries.append(("term-dup", "Term dup\n\n   " + entries[0][1].split("\n\n", 1)[1]))  # term0's definition again
    body, index = b"", []
    for term, text in entries:
        data = text.encode()
        index.append(f"{term}\t{dictd_code(len(body))}\t{dictd_code(len(data))}")
        body += data
    (root / "foldoc.index").write_text("\n".join(index) + "\n")
    (root / "foldoc.dict.dz").write_bytes(gzip.compress(body))
    return {"words": words, "man": root / "man", "foldoc": root / "foldoc"}


def build_args(out: Path, sources: dict[str, Path], *extra: str) -> list[str]:
    return ["build", "--out", str(out), "--sources", "pydoc,docstrings,man,foldoc,words,math", "--packages", "tqdm",
            "--man-dir", str(sources["man"]), "--foldoc", str(sources["foldoc"]), "--words-file",
            str(sources["words"]), "--max-per-source", "120", "--math-problems", "120", "--heldout-fraction", "0.2",
            *extra]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def built(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    assert corpus_main(build_args(out, sources)) == 0
    return out


def test_dedup_drops_exact_and_near_duplicates_and_keeps_distinct_texts():
    d = Dedup(0.8)
    assert d.duplicate(PARAGRAPH) is None
    assert d.duplicate("  " + PARAGRAPH.upper().replace(",", " ;") + "!") == "exact"
    assert d.duplicate(PARAGRAPH.replace("watermark", "reserve")) == "near"  # one word of 70
    half = " ".join(PARAGRAPH.split()[:35]) + " and then the story goes somewhere else entirely, about boats on a " \
                                              "river at night, lanterns, nets, fish, the cold, and a long way home"
    assert d.duplicate(half) is None  # shares half its shingles: not a near duplicate
    assert d.duplicate("A different text about the weather in spring, rain and sun and wind over the hills.") is None
    assert d.duplicate("short text") is None and d.duplicate("Short  text!") == "exact"
    assert normalise("Hello,  World!") == "hello world"
    exact_only = Dedup(None)
    assert exact_only.duplicate(PARAGRAPH) is None and exact_only.duplicate(PARAGRAPH.replace("watermark", "x")) is None


def test_man_pages_become_plain_text():
    sec = troff_sections(MAN_PAGE)
    assert sec["NAME"] == "frob, frobnicate - adjust the widgets of a file"
    assert sec["DESCRIPTION"].startswith("frob reads each FILE and adjusts its widgets in place-quickly.")
    assert "--no-backup" in sec["DESCRIPTION"] and "\\" not in sec["DESCRIPTION"] and "comment" not in str(sec)


def test_the_split_never_shares_a_source_document(built):
    train, heldout = read(built / "prompts.jsonl"), read(built / "heldout.jsonl")
    assert not {r["doc"] for r in train} & {r["doc"] for r in heldout}
    assert {r["source"] for r in train} == {"pydoc", "docstrings", "man", "foldoc", "words", "math"}
    assert len({r["source"] for r in heldout}) >= 4 and 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.4
    assert {r["category"] for r in train} == {"explanation", "how-to", "code", "math", "writing", "conversation"}
    seen = {normalise(r["prompt"]) for r in train}
    assert not any(normalise(r["prompt"]) in seen for r in heldout)
    assert {r["doc"] for r in train if r["source"] == "man"} <= {"man:frob", "man:glint"}  # frob-extra is frob's
    assert len({r["id"] for r in train + heldout}) == len(train) + len(heldout)


def test_whole_sources_can_be_held_out(sources, tmp_path):
    assert corpus_main(build_args(tmp_path, sources, "--sources", "words,math", "--heldout-sources", "words")) == 0
    train, heldout = read(tmp_path / "prompts.jsonl"), read(tmp_path / "heldout.jsonl")
    assert {r["source"] for r in train} == {"math"} and sum(r["source"] == "words" for r in heldout) == 2 * 11


def test_the_manifest_records_sources_and_counts_that_match_the_files(built):
    m = json.loads((built / "manifest.json").read_text())
    for split, name in (("train", "prompts.jsonl"), ("heldout", "heldout.jsonl")):
        records = read(built / name)
        c = m["split"][split]
        assert c["prompts"] == len(records) == m["files"][name]["lines"]
        assert c["by_source"] == dict(Counter(r["source"] for r in records))
        assert c["by_category"] == dict(Counter(r["category"] for r in records))
        assert c["documents"] == len({r["doc"] for r in records})
        assert sum(c["by_source_category"].values()) == len(records)
    assert all(s["status"] == "ok" for s in m["sources"].values()) and len(m["sources"]) == 6
    assert m["sources"]["words"]["seeds_found"] == 11 and m["sources"]["math"]["seeds_kept"] == 120
    doc = m["sources"]["docstrings"]
    assert 20 < doc["seeds_kept"] == min(120, doc["seeds_found"]) and m["seed"] == 0
    assert m["dedup"]["dropped"].get("train/foldoc/exact", 0) + m["dedup"]["dropped"].get("heldout/foldoc/exact", 0) \
        == 1  # term-dup
    estimate = m["estimate"]
    assert estimate["prompts_needed"] == 100_000 and estimate["train_prompts"] == m["split"]["train"]["prompts"]


def test_a_missing_source_is_named_and_the_rest_still_build(sources, tmp_path, capsys):
    args = build_args(tmp_path, sources, "--sources", "words,math,foldoc", "--words-file", str(tmp_path / "nope"))
    assert corpus_main(args) == 0
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["sources"]["words"]["status"] == "missing" and "corpus_sources.sh" in m["sources"]["words"]["reason"]
    assert "source words missing" in capsys.readouterr().err and m["split"]["train"]["by_source"].keys() == \
        {"math", "foldoc"}
    assert corpus_main(build_args(tmp_path, sources, "--sources", "words,poems")) == 2
    assert "unknown source 'poems'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        corpus_main(build_args(tmp_path, sources, "--max-per-doc", "0"))
    assert "--max-per-doc: '0' is not a whole number >= 1" in capsys.readouterr().err


def test_the_build_is_deterministic_for_a_seed(built, sources, tmp_path):
    assert corpus_main(build_args(tmp_path / "a", sources)) == 0
    for name in ("prompts.jsonl", "heldout.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (built / name).read_bytes()
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (tmp_path / "a", built))
    assert {**ma, "timing_seconds": None} == {**mb, "timing_seconds": None}
    assert corpus_main(build_args(tmp_path / "b", sources, "--seed", "1")) == 0
    assert (tmp_path / "b" / "prompts.jsonl").read_bytes() != (built / "prompts.jsonl").read_bytes()


GEN = ["--model", "k2-tiny", "--device", "cpu", "--max-new-tokens", "3", "--batch", "2", "--shard-size", "2",
       "--target-tokens", "1000000"]
SMALL = ["--sources", "words,math", "--max-per-source", "4", "--math-problems", "1", "--heldout-fraction", "0",
         "--heldout-sources", "math"]  # 8 training prompts (4 shards), 2 held out


@pytest.fixture(scope="module")
def generated(sources, tmp_path_factory) -> tuple[Path, Path]:
    """The same small corpus generated twice: in one run, and in three (one shard; then on to 10 response
    tokens, which stops after the second shard of 2 x 3 tokens; then the rest)."""
    dirs = [tmp_path_factory.mktemp(n) for n in ("one", "resumed")]
    for d in dirs:
        assert corpus_main(build_args(d, sources, *SMALL)) == 0
    assert corpus_main(["generate", "--corpus", str(dirs[0]), *GEN]) == 0
    resumed = dirs[1] / "responses"
    assert corpus_main(["generate", "--corpus", str(dirs[1]), *GEN, "--max-shards", "1"]) == 0
    assert len(list(resumed.glob("shard-*.jsonl"))) == 1
    first = (resumed / "shard-00000.jsonl").stat().st_mtime_ns
    assert corpus_main(["generate", "--corpus", str(dirs[1]), *GEN[:-1], "10"]) == 0
    rec = json.loads((resumed / "generation.json").read_text())
    assert len(list(resumed.glob("shard-*.jsonl"))) == rec["shards_done"] == 2 and rec["response_tokens"] == 12
    assert rec["prompts_needed"] == 4 and rec["tokens_per_response"] == 3
    assert corpus_main(["generate", "--corpus", str(dirs[1]), *GEN]) == 0
    assert (resumed / "shard-00000.jsonl").stat().st_mtime_ns == first  # finished shards are not redone
    return dirs[0], dirs[1]


def test_generation_resumes_to_the_same_result(generated, capsys):
    one, resumed = generated
    shards = sorted(p.name for p in (one / "responses").glob("shard-*.jsonl"))
    prompts = read(one / "prompts.jsonl")
    assert len(shards) == len(prompts) // 2 == 4 and shards == sorted(
        p.name for p in (resumed / "responses").glob("shard-*.jsonl"))
    for name in shards:
        assert (one / "responses" / name).read_bytes() == (resumed / "responses" / name).read_bytes()
    rows = [r for name in shards for r in read(one / "responses" / name)]
    assert [r["id"] for r in rows] == [r["id"] for r in prompts]
    assert all(len(r["response_ids"]) == 3 and r["prompt_ids"] for r in rows)
    rec = json.loads((resumed / "responses" / "generation.json").read_text())
    assert rec["shards_done"] == rec["shards"] == len(shards) and rec["response_tokens"] == 3 * len(rows)
    assert rec == json.loads((one / "responses" / "generation.json").read_text())
    assert sum(c["prompts"] for c in rec["by_category"].values()) == len(rows) and set(rec["by_category"]) <= {
        "explanation", "writing", "conversation", "how-to"}
    assert corpus_main(["generate", "--corpus", str(one), *GEN]) == 0  # all done: nothing to do
    assert "nothing to do" in capsys.readouterr().err
    assert corpus_main(["generate", "--corpus", str(one), *GEN[:-6], "--max-new-tokens", "6"]) == 2
    assert "max_new_tokens: 3 -> 6" in capsys.readouterr().err
    assert corpus_main(["generate", "--corpus", str(one / "nope"), *GEN]) == 2
    assert "not a built corpus" in capsys.readouterr().err


def test_train_drafter_trains_on_the_corpus(generated, tmp_path, capsys):
    from kdray.cli import main as kdray_main
    from kdray.train_drafter import main as train

    corpus = generated[0]
    n = len(read(corpus / "prompts.jsonl"))
    out = tmp_path / "drafter"
    assert train(["--model", "k2-tiny", "--corpus", str(corpus), "--output", str(out), "--device", "cpu",
                  "--layers", "1", "--target-layers", "2", "--block-size", "8", "--steps", "3", "--batch-size", "4",
                  "--anchors", "4", "--log-every", "1", "--checkpoints", "1", "--eval-prompts", "1",
                  "--eval-tokens", "4", "--eval-budget", "8"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["data"]["source"] == f"corpus {corpus}" and log["data"]["sequences"] == n
    assert log["data"]["response_tokens"] == 3 * n and log["data"]["eval_categories"] == ["math"]
    assert len(log["curve"]) == 3 and (out / "model.safetensors").is_file()
    assert kdray_main(["train-drafter", "--model", "smollm2-135m", "--corpus", str(corpus), "--output",
                       str(tmp_path / "x"), "--steps", "1"]) == 2
    assert "generated by k2-tiny" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train(["--model", "k2-tiny", "--corpus", str(tmp_path / "none"), "--output", str(out), "--steps", "1"])
    assert "no such directory" in capsys.readouterr().err
