"""GPU kernel benchmark: every kdray CUDA op against the machine's measured ceilings and a torch baseline.

    python benchmarks/bench_kernels.py [--only tree,attention,prefill,moe,linear]

Prints one Markdown table (time, ratio to the roofline floor, achieved rate, speed-up over the named
torch baseline, the target) for pasting into benchmarks/RESULTS.md. (Not named ``kernels.py``: run as a script,
that file would shadow the ``kernels`` package transformers imports, for every benchmark in this folder.)
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Ceilings, print_table  # noqa: E402

SECTIONS = {"tree": "benchmarks.bench_tree", "attention": "benchmarks.bench_attention",
            "prefill": "benchmarks.bench_prefill_attention", "moe": "benchmarks.bench_moe",
            "linear": "benchmarks.bench_linear"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ", ".join(SECTIONS))
    args = ap.parse_args()
    ceil = Ceilings.measure()
    print(f"# {datetime.date.today()} {torch.cuda.get_device_name()}: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 GEMM {ceil.bf16_flop_per_s / 1e12:.0f} TFLOP/s")
    rows = []
    for name in args.only.split(","):
        rows += importlib.import_module(SECTIONS[name]).bench(ceil)
    print_table([r.cells() for r in rows])


if __name__ == "__main__":
    main()
