"""Host time of the engine's plain AR step at large batch, stage by stage.

Greedy AR generation (``spec="ar"``, what ``kdray.train_drafter.ar_llm`` runs) of ``--batch`` prompts at once.
Each decode step's wall time (steps with a prefill left out) is split into: schedule (admission, the decode batch,
pages), inputs (the runner's slot index, grown block-table rows, the batch's settings; on cuda also the graph
replay), forward (the target pass and its logits), sample (the choice), commit (the KV kept), device rest (the
step's other tensor work; on the CPU also freeing the step's logits), wait (for the step before's results: device
time the host does not hide; on cuda with their unpacking), to host (the copy back; on the CPU unpacked), update
(tokens applied to requests), detokenize, outputs (``RequestOutput`` objects), and the rest of the engine and
``LLM.generate`` loop. "host" is the step less wait and, on the CPU, less forward, sample, commit and device rest
(the tiny model's tensor work stands in for the GPU's; on cuda they are launches, host work).

``--steady``: 3 x batch prompts of 0.5-1.5 x the new tokens each, so requests finish and are admitted every step,
as in a long job: steps count while requests wait, prefills included (prefill: its host work and the first tokens'
choice; its forward counts as forward). ``--stream``: the engine stepped as the Serve path steps it, every request
reporting what it added at every step (joined per request), instead of ``LLM.generate``'s finished outputs alone.

    python benchmarks/host_step.py --device cpu     # tiny Llama: hidden 64, 2 layers, SmolLM2's vocab and tokenizer
    python benchmarks/host_step.py --device cuda    # smollm2-135m, bfloat16, CUDA graphs (the runner's stages replay)
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from kdray.engine.engine import Engine  # noqa: E402
from kdray.engine.request import SamplingParams, join_output  # noqa: E402
from kdray.engine.runner import ModelRunner  # noqa: E402
from kdray.engine.scheduler import Scheduler  # noqa: E402
from kdray.engine.step import Pending  # noqa: E402
from kdray.llm import LLM  # noqa: E402
from kdray.model.loader import LoadedTarget, load_target  # noqa: E402
from kdray.model.tokenizer import IncrementalDetokenizer  # noqa: E402
from kdray.train_drafter import kv_pages  # noqa: E402

# (owner, method) -> stage; time inside a method counts once, to the innermost stage (exclusive times)
STAGES = {
    (Scheduler, "admit"): "schedule", (Scheduler, "decode_batch"): "schedule", (Scheduler, "reserve"): "schedule",
    (Scheduler, "prefill_chunks"): "schedule", (ModelRunner, "step"): "inputs",
    (ModelRunner, "_step_fn"): "device rest",
    (ModelRunner, "verify"): "forward", (ModelRunner, "accept"): "sample", (ModelRunner, "commit"): "commit",
    (ModelRunner, "prefill"): "prefill", (ModelRunner, "forward_prompts"): "forward",
    (ModelRunner, "_to_host"): "to host", (Pending, "result"): "wait", (Engine, "_collect"): "update",
    (Engine, "_output"): "outputs", (IncrementalDetokenizer, "add"): "detokenize",
    (IncrementalDetokenizer, "flush"): "detokenize",
}
DEVICE = ("forward", "sample", "commit", "device rest")  # the CPU's stand-in for device work (on a GPU: launches)
ORDER = ("schedule", "inputs", "forward", "sample", "commit", "device rest", "wait", "to host", "prefill", "update",
         "detokenize", "outputs", "rest")


class StageClock:
    """Exclusive wall time per stage, by wrapping the methods of :data:`STAGES` (a stack of open stages)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [stage, start, time spent in inner stages]
        self._saved = []

    def install(self):
        for (owner, name), stage in STAGES.items():
            fn = getattr(owner, name)
            self._saved.append((owner, name, fn))
            setattr(owner, name, self._wrap(fn, stage))

    def remove(self):
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        self._saved = []

    def _wrap(self, fn, stage: str):
        clock = self

        def timed(*args, **kwargs):
            clock._stack.append([stage, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                stage_, start, inner = clock._stack.pop()
                spent = time.perf_counter() - start
                clock.seconds[stage_] += spent - inner
                if clock._stack:
                    clock._stack[-1][2] += spent

        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def tiny_target(vocab: int, hidden: int, layers: int, context: int = 2048) -> LoadedTarget:
    """A random Llama (``hidden``, ``layers``, ``vocab``, ``context`` positions) with SmolLM2's tokenizer, fp32 on
    the CPU."""
    import transformers

    from kdray.model.gguf import open_gguf, smollm2_path

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=hidden // 4, max_position_embeddings=context, initializer_range=0.1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        transformers.LlamaForCausalLM(cfg).save_pretrained(d)
        target = load_target(d)
    _, reader, tokenizer = open_gguf(smollm2_path())
    reader.close()
    target.tokenizer = tokenizer
    return target


def measure(target: LoadedTarget, batch: int, prompt_len: int, new_tokens: int, clock: StageClock | None,
            steady: bool = False, stream: bool = False) -> dict:
    """Generate for ``batch`` random prompts (after a warm-up generation) -> mean ms per decode step, per stage with a
    ``clock`` (work done once per request, at its end, is shared over the steps); ``stream``: every step reports
    every request, as for the Serve path."""
    llm = LLM(model=target, spec="ar", max_num_seqs=batch, max_tokens_per_step=32768,
              num_pages=kv_pages([prompt_len] * batch, new_tokens, 2))
    g = torch.Generator().manual_seed(batch)
    vocab = target.config.vocab_size
    n = 3 * batch if steady else batch
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]
    lengths = [new_tokens] * n
    if steady:
        lengths = torch.randint(new_tokens // 2, new_tokens * 3 // 2 + 1, (n,), generator=g).tolist()
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in lengths]
    warm = prompts if next(target.model.parameters()).is_cuda else prompts[:8]  # cuda: the batch's graph captured
    llm.generate(prompt_token_ids=warm, sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
    engine, runner, steps, prefills = llm.engine, llm.engine.runner, [], [0]
    step = engine.step

    def timed_step(**kwargs):
        if clock:
            clock.take()
        before, queued, t = prefills[0], bool(engine.scheduler.waiting), time.perf_counter()
        out = step(**kwargs)
        counted = queued if steady else prefills[0] == before  # steady: while finished requests are replaced
        steps.append((time.perf_counter() - t, clock.take() if clock else {}, counted))
        return out

    if clock:
        clock.install()
    launch = runner.launch

    def counted_launch(prefill, step):  # a step with prompt chunks, in their own pass or riding in the step's
        prefills[0] += prefill is not None
        return launch(prefill, step)

    engine.step, runner.launch = timed_step, counted_launch
    try:
        sync()
        t = time.perf_counter()
        if stream:  # as the Serve path runs it: every step's outputs, joined per request
            for i, (ids, p) in enumerate(zip(prompts, params)):
                engine.add_request(str(i), ids, p)
            whole = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    join_output(whole, out)
            engine.drain()
            outs = [whole[str(i)] for i in range(n)]
        else:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        sync()
        total = time.perf_counter() - t
    finally:
        if clock:
            clock.remove()
        del engine.step, runner.launch
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    decode = [(w, s) for w, s, counted in steps if counted][1:]  # the first applies the first prefill
    n, wall, stages = len(decode), sum(w for w, _ in decode), defaultdict(float)
    for _, s in decode:
        for k, v in s.items():
            stages[k] += v
    stages["rest"] = wall - sum(stages.values())
    llm.shutdown()
    return {"batch": batch, "steps": n, "step_ms": 1e3 * wall / n, "tok_s": batch * new_tokens / total,
            "stages_ms": {k: 1e3 * v / n for k, v in stages.items()}}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 32 on cpu, 256 on cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--steady", action="store_true", help="requests finishing and admitted every step (see above)")
    ap.add_argument("--stream", action="store_true",
                    help="step the engine as the Serve path does (every request's output at every step) instead of "
                         "LLM.generate (finished requests' outputs only)")
    ap.add_argument("--stages", choices=("on", "off"), default="on",
                    help="split the step by stage (wrapping the stages' methods costs ~1 us a call)")
    args = ap.parse_args()
    if args.device == "cuda":
        target, new_tokens = load_target("smollm2-135m", "bfloat16", "cuda"), args.new_tokens or 256
    else:
        torch.set_num_threads(args.threads)
        new_tokens = args.new_tokens or 32
        target = tiny_target(49152, 64, 2, max(2048, args.prompt_len + 2 * new_tokens))  # --steady: up to 1.5x new
    clock = StageClock() if args.stages == "on" else None
    rows = []
    for b in args.batch:
        r = measure(target, b, args.prompt_len, new_tokens, clock, args.steady, args.stream)
        row = [str(b), str(r["steps"]), f"{r['step_ms']:.2f}", f"{r['tok_s']:.0f}"]
        if clock:
            s = r["stages_ms"]
            device = ("wait",) + (DEVICE if args.device == "cpu" else ())
            host = r["step_ms"] - sum(s.get(k, 0.0) for k in device)
            row += [f"{host:.2f}", f"{1e3 * host / b:.2f}"] + [f"{s.get(k, 0.0):.2f}" for k in ORDER]
        rows.append(row)
    model = "smollm2-135m bf16" if args.device == "cuda" else "tiny Llama (hidden 64, 2 layers, vocab 49152) fp32"
    new = (f"{new_tokens} new tokens" + (" (0.5-1.5x, 3x batch prompts: steady)" if args.steady else "")
           + (", streamed outputs" if args.stream else ""))
    print(f"\n# {datetime.date.today()} host_step on {args.device}: {model}, AR greedy, prompts {args.prompt_len} "
          f"tokens, {new}, torch threads {torch.get_num_threads()}; ms per decode step")
    header = ["batch", "steps", "step ms", "tok/s (prefill incl.)"]
    if clock:
        header += ["host ms", "host us / seq-step"] + [f"{k} ms" for k in ORDER]
    print_table(rows, header)


if __name__ == "__main__":
    main()
