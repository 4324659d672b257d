"""Decode step time of a batch that holds a thinking model's grammar request while its thought runs.

A grammar after a free thought (``response_format`` on Kimi-K2-Thinking: :func:`~kdray.spec.grammar.after_reasoning`)
used to mask every step of its batch on the host, through the whole thought: the batch's steps ran eagerly. Now the
thought's one mask goes to the runner's slot once and the batch replays its CUDA graph, pipelined (the host launches
step k + 1 before it reads step k; a slot whose thought ends halts until the host has seen that end). This times
both, against the same batch without the grammar request.

Model: Kimi-K2's architecture at k2-tiny's dimensions with ``--layers`` layers (61, K2's count, by default: an eager
step's host time grows with the layers' launches, not with their width), random weights, behind the K2-layout
thinking tokenizer of ``tests/k2_chat.py``. A batch of ``--batch`` requests of ``--tokens`` tokens each: one (or all,
``--all-thinking``) asks for a JSON schema after a thought that a logit bias opens at once and keeps running; the rest
are plain. Rows: AR and DDTree (random drafter, its trees verified whatever they hold), each with the thought on its
mask (now), with masks every step (before), and without the grammar request. Step time = the decode steps' mean wall
time (prefill steps and each run's first steps, which capture graphs, left out).

    python benchmarks/thought_step.py --device cuda          # prints the table
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from benchmarks.common import print_table  # noqa: E402
from k2_chat import make_k2_chat_checkpoint, token_ids  # noqa: E402
from kdray import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from kdray.config import K2Config  # noqa: E402
from kdray.model.presets import K2_TINY, k2_random_tensors, write_checkpoint  # noqa: E402
from kdray.spec.grammar import GrammarState, after_reasoning  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["city", "n"]}
HEADER = ["spec", "batch", "thinking", "grammar request", "step ms", "vs without"]


def checkpoint(root: Path, layers: int) -> Path:
    """The thinking tokenizer and template, K2's architecture at k2-tiny's dims with ``layers`` layers."""
    path = make_k2_chat_checkpoint(root / "thinking-k2", thinking=True)
    ids = token_ids()
    config = {**K2_TINY, "num_hidden_layers": layers, "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["[BOS]"]}
    write_checkpoint(path, config, k2_random_tensors(K2Config.from_hf(config), 0))
    return path


def step_times(llm: LLM, params: list[SamplingParams], prompts: list[list[int]], skip: int) -> list[float]:
    """Wall seconds of each decode step (no prefill in it) after the first ``skip`` of them."""
    engine = llm.engine
    for i, (p, prompt) in enumerate(zip(params, prompts)):
        engine.add_request(f"r{i}", prompt, p)
    times, decode = [], 0
    while engine.has_unfinished_requests():
        waiting = engine.num_waiting() or any(s.prefilled < s.prefill_len for s in engine.scheduler.running)
        start = time.perf_counter()
        engine.step(stream=False)
        took = time.perf_counter() - start
        if not waiting:
            decode += 1
            if decode > skip:
                times.append(took)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--all-thinking", action="store_true", help="every request thinks under a grammar")
    args = ap.parse_args(argv)
    ids = token_ids()
    think, end = ids["<think>"], ids["</think>"]
    grammar = after_reasoning(StructuredOutputsParams(json=SCHEMA), think, end, False)
    thinking = SamplingParams(max_tokens=args.tokens, structured_outputs=grammar,
                              logit_bias={think: 30.0, end: -100.0})  # the thought opens at once and runs on
    plain = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    n_thinking = args.batch if args.all_thinking else 1
    prompts = [[300 + i, 301, 302, 303] for i in range(args.batch)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp), args.layers)
        for spec in ("ar", "ddtree"):
            kw = dict(drafter="random", budget=16, block_size=8) if spec == "ddtree" else {}
            with LLM(model=str(path), spec=spec, device=args.device, **kw) as llm:
                rows += compare(llm, spec, args, prompts, plain, thinking, n_thinking)
    print(f"\nK2 architecture, k2-tiny dims, {args.layers} layers, {args.device}; {args.tokens} tokens a request")
    print_table(rows, HEADER)
    return 0


def compare(llm: LLM, spec: str, args, prompts: list[list[int]], plain: SamplingParams, thinking: SamplingParams,
            n_thinking: int) -> list[list[str]]:
    """The three cases' rows on one engine."""
    mixed = [thinking] * n_thinking + [plain] * (args.batch - n_thinking)
    cases = {"without": ([plain] * args.batch, None), "its thought's mask (now)": (mixed, None),
             "masks every step (before)": (mixed, lambda self, vocab: None)}
    ms, rows = {}, []
    for name, (params, patch) in cases.items():
        with mock.patch.object(GrammarState, "thought_mask", patch or GrammarState.thought_mask):
            step_times(llm, params, prompts, 0)  # warm-up: graphs captured, the grammar compiled
            ms[name] = 1e3 * statistics.mean(step_times(llm, params, prompts, 2))
        rows.append([spec, str(args.batch), str(n_thinking), name, f"{ms[name]:.2f}",
                     f"{ms[name] / ms['without']:.2f}x"])
    return rows


if __name__ == "__main__":
    sys.exit(main())
