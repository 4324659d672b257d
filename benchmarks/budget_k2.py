"""What budget="auto" would choose on K2 (a simulation): the policy of ``kdray.spec.budget`` fed the K2 TP8-shard
step times of ``benchmarks/k2_step.py`` and the acceptance measured on SmolLM2 with the shipped drafter.

Cost: the projected TP8 step (one shard's verify pass from a CUDA graph plus two all-reduces per layer) per
(batch, tree nodes) as ``k2_step.py`` measured it on an H200 (RESULTS.md, 2026-11-30, after the fused layer);
other batches come from the policy's own linear model in the pass's tokens. Acceptance: SmolLM2's tokens per
step at each fixed budget (``benchmarks/e2e.py``, batch 1, H200, 2026-12-01), interpolated in log(nodes).
Prints, for batch 1, 8 and 32, the width the policy picks and the predicted tokens per second against every
fixed budget. It runs no model: the numbers are a prediction, said so in the table.

    python benchmarks/budget_k2.py [--e2e-json benchmarks/results/e2e-smollm2-device-step-2026-12-01.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from kdray.spec.budget import BudgetPolicy  # noqa: E402

# (batch, tree nodes) -> projected TP8 K2 step, seconds (k2_step.py "after", H200, 2026-11-30)
K2_TP8_STEP = {(1, 0): 9.64e-3, (1, 16): 12.10e-3, (1, 64): 17.92e-3, (1, 256): 33.27e-3, (8, 0): 11.90e-3,
               (32, 64): 151.14e-3}
DEPTH = 15  # the drafter's block of 16: 15 draft positions


def measured_tau(path: Path) -> dict[int, float]:
    """Tokens per step at batch 1 for each fixed budget of an e2e JSON (AR counts as budget 0)."""
    rows = json.loads(path.read_text())["rows"]
    taus = {0: 1.0}
    for r in rows:
        if r["mode"] == "ddtree" and isinstance(r["budget"], int) and r["budget"] > 0:
            taus[r["budget"]] = r["batch1"]["tau"]
    return taus


def tau_at(taus: dict[int, float], w: int) -> float:
    """Interpolate tokens per step in log(1 + nodes) between measured budgets (flat beyond the largest)."""
    xs = sorted(taus)
    if w in taus:
        return taus[w]
    hi = next((x for x in xs if x > w), xs[-1])
    lo = max(x for x in xs if x < w)
    if hi == lo:
        return taus[lo]
    f = (math.log1p(w) - math.log1p(lo)) / (math.log1p(hi) - math.log1p(lo))
    return taus[lo] + f * (taus[hi] - taus[lo])


def policy_for(taus: dict[int, float]) -> BudgetPolicy:
    policy = BudgetPolicy(max_nodes=256, depth=DEPTH)
    policy.warm(K2_TP8_STEP)
    return policy


def report(taus: dict[int, float], batch: int, policy: BudgetPolicy) -> list[list[str]]:
    """One row per fixed width and one for the policy's choice: predicted tok/s of ``batch`` sequences."""
    # each sequence's report puts its expected accepted drafts at depth 1, so 1 + mass = tokens per step
    masses = [[[tau_at(taus, w) - 1] + [0.0] * (DEPTH - 1) for w in policy.widths]] * batch
    rows = []
    for w in policy.widths:
        tok_s = batch * tau_at(taus, w) / policy.cost(batch, w)
        rows.append([str(batch), str(w), f"{tau_at(taus, w):.2f}", f"{1e3 * policy.cost(batch, w):.1f}",
                     f"{tok_s:.0f}", ""])
    chosen = policy.choose(masses)
    best = max(rows, key=lambda r: float(r[4]))
    rows.append([str(batch), f"auto -> {chosen}", f"{tau_at(taus, chosen):.2f}",
                 f"{1e3 * policy.cost(batch, chosen):.1f}",
                 f"{batch * tau_at(taus, chosen) / policy.cost(batch, chosen):.0f}",
                 f"{float(rows[policy.widths.index(chosen)][4]) / float(best[4]):.2f}x the best fixed"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--e2e-json", type=Path,
                    default=Path(__file__).parent / "results" / "e2e-smollm2-device-step-2026-12-01.json")
    args = ap.parse_args(argv)
    taus = measured_tau(args.e2e_json)
    rows = []
    for batch in (1, 8, 32):
        rows += report(taus, batch, policy_for(taus))
    print("# budget_k2 (a simulation: K2 TP8 step times from k2_step.py, SmolLM2's acceptance; no model runs)")
    print_table(rows, ["batch", "tree nodes", "tokens/step", "step ms", "predicted tok/s", "auto"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
