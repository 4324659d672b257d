"""A broad self-distilled corpus for training a DFlash drafter: prompts built offline, responses by the target.

Build (CPU, minutes; deterministic for a seed on a given machine's sources), then generate (the target, on a GPU
for the real run; resumable), then train::

    bash scripts/corpus_sources.sh                      # apt: word list, FOLDOC, manual pages (optional)
    python -m kdray.drafter_corpus build --out corpus/ --seed 0
    python -m kdray.drafter_corpus generate --corpus corpus/ --model smollm2-135m   # rerun to resume
    kdray train-drafter --corpus corpus/ --model smollm2-135m --output drafter/ --train-seconds 3600

(``kdray drafter-corpus build|generate`` is the same command.)

Sources (``--sources``; one whose files are absent is skipped and named in the manifest): ``pydoc`` (Python's
language reference, one document per topic), ``docstrings`` (module, class and function docstrings of the
standard library and every installed distribution, parsed with ``ast``; one document per top-level package),
``man`` (NAME and DESCRIPTION of the manual pages; one document per command family), ``foldoc`` (the Free
On-line Dictionary of Computing; one per term), ``words`` (a word list as topic seeds; one per word) and
``math`` (generated word problems; one per problem). Templates turn each seed into ``--prompts-per-seed``
prompts across the categories explanation, how-to, code, math, writing and conversation.

The build caps each source document and source, holds out ``--heldout-fraction`` of each source's documents
(or ``--heldout-sources`` whole), drops exact (after normalisation) and near duplicates (MinHash of word
5-grams, Jaccard >= ``--near-threshold``; a held-out seed that repeats a training one is dropped) and writes:

    prompts.jsonl    training prompts, shuffled: {"id", "source", "doc", "kind", "category", "prompt"}
    heldout.jsonl    held-out prompts, same fields; no "doc" in common with prompts.jsonl
    manifest.json    options and seed, sources (found, kept, missing and why), dedup drops, counts per split,
                     source and category, file line counts and hashes, the prompts --target-tokens needs
    responses/       after generate: shard-NNNNN.jsonl ({"id", "source", "category", "prompt_ids",
                     "response_ids", "finish_reason"}) and generation.json (settings, token counts)
"""
