"""Economic speculation: how many tree nodes each step verifies (``budget="auto"``).

A bigger tree accepts more tokens but costs more to verify. Each step the engine picks the tree width w (nodes
per sequence, from :data:`WIDTHS`; 0 is plain decoding) that maximises the batch's expected committed tokens per
second of step time:

- Expected tokens: the tree is best first, so its first w nodes are the tree of budget w, and the expected
  accepted length of a sequence is ``1 + sum over those nodes of c[depth] * p(node)``, with ``p`` the node's path
  probability under the drafter and ``c`` a per-depth calibration: the acceptance actually observed at that
  depth over the probability the drafter gave it (updated after every step). Each step's trees report, per
  sequence, the probability mass at each depth among their first w nodes for every candidate w
  (:func:`width_masses`); the policy uses each sequence's latest report.
- Cost: a table of step times per (batch bucket, w), measured at warm-up for one sequence and refined from the
  device time of every step; entries not seen yet come from a linear model in the pass's tokens.

The choice changes what is verified, never what is accepted: losslessness does not depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

WIDTHS = (0, 8, 16, 32, 64, 128, 256)  # tree nodes per sequence a step may verify
EMA = 0.1  # weight of the newest observation in the running estimates
EXPLORE = 32  # plain steps in a row after which a small tree is tried again


def width_masses(logits: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
                 widths: torch.Tensor, depth: int) -> torch.Tensor:
    """Per sequence, the drafter's probability mass at each depth among the first w nodes of its best-first tree,
    for every w in ``widths`` (int64, on the logits' device: the function runs inside CUDA graphs).

    logits ``[B, L, V]`` (the drafter's), tokens / depths ``[B, 1+N]`` of the tree, ancestors ``[B, 1+N, 1+N]``
    bool (node i's ancestors, itself included) -> masses ``[B, len(widths), L]`` fp32.
    """
    B, n1 = tokens.shape
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, L, V]
    d = (depths.long() - 1).clamp(min=0)  # [B, 1+N]
    node_lp = logp.gather(2, tokens.long().clamp(min=0)[:, None, :].expand(-1, logp.shape[1], -1))  # [B, L, 1+N]
    node_lp = node_lp.gather(1, d[:, None, :]).squeeze(1) * (depths > 0)  # [B, 1+N], root 0
    path = torch.exp(torch.bmm(ancestors.float(), node_lp[..., None]).squeeze(-1))  # [B, 1+N]
    one_hot = torch.nn.functional.one_hot(d, depth) * (depths > 0)[..., None]  # [B, 1+N, L]
    cum = torch.cumsum(path[..., None] * one_hot, dim=1)  # [B, 1+N, L]: mass among nodes 0..i
    return cum[:, widths.clamp(max=n1 - 1)]  # [B, len(widths), L]


def bucket_of(batch: int) -> int:
    """The power-of-two batch bucket a step's cost is recorded under."""
    return 1 << max(0, (batch - 1).bit_length())


@dataclass
class BudgetPolicy:
    """Chooses each step's tree width from the trees' reported masses, the calibration and the cost table."""

    max_nodes: int
    depth: int  # L: draft positions
    widths: list[int] = field(default_factory=list)
    calibration: list[float] = field(default_factory=list)  # c per depth 1..L
    costs: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch bucket, w) -> step seconds
    per_token: float = 0.0  # seconds per verified token beyond one sequence's, for unseen entries
    host_seconds: float = 0.0  # per-step time the device waits for the host
    chosen: dict[int, int] = field(default_factory=dict)  # w -> steps it was chosen (the metrics' histogram)
    _observed: list[float] = field(default_factory=list)
    _predicted: list[float] = field(default_factory=list)
    _plain_run: int = 0  # steps in a row at width 0

    def __post_init__(self):
        self.widths = [w for w in WIDTHS if w <= self.max_nodes] or [0]
        self.calibration = [1.0] * self.depth
        self._observed, self._predicted = [1.0] * self.depth, [1.0] * self.depth

    def warm(self, measured: dict[tuple[int, int], float]):
        """Step seconds measured on this device, per (batch bucket, width): the cost table's first entries (one
        sequence's at least) and the per-token slope for batches not measured."""
        self.costs.update(measured)
        one = {w: s for (b, w), s in measured.items() if b == 1}
        if len(one) > 1:
            lo, hi = min(one), max(one)
            self.per_token = max(0.0, (one[hi] - one[lo]) / max(1, hi - lo))

    def cost(self, batch: int, w: int) -> float:
        """Expected seconds of a step of ``batch`` sequences verifying ``w`` nodes each (host wait included): the
        table's entry, else one sequence's cost at ``w`` plus the per-token slope for the other sequences."""
        b = bucket_of(batch)
        if (b, w) in self.costs:
            return self.costs[(b, w)] + self.host_seconds
        return self._one_sequence(w) + self.per_token * (b - 1) * (1 + w) + self.host_seconds

    def _one_sequence(self, w: int) -> float:
        """One sequence's step at ``w``: measured, else interpolated between the measured widths (extended by
        the per-token slope past the largest)."""
        row = sorted((w1, s) for (b, w1), s in self.costs.items() if b == 1)
        if not row:
            return 1e-3
        below = [(w1, s) for w1, s in row if w1 <= w]
        above = [(w1, s) for w1, s in row if w1 >= w]
        if not below:
            return above[0][1]
        (w0, s0) = below[-1]
        if not above:
            return s0 + self.per_token * (w - w0)
        (w1, s1) = above[0]
        return s0 if w1 == w0 else s0 + (s1 - s0) * (w - w0) / (w1 - w0)

    def expected_tokens(self, masses: list[list[list[float]] | None], k: int) -> float:
        """Expected tokens committed by a step at ``widths[k]`` over the batch; sequences without a report yet
        count as the batch's mean."""
        known = [1 + sum(c * m for c, m in zip(self.calibration, seq[k])) for seq in masses if seq is not None]
        mean = sum(known) / len(known) if known else 1.0
        return sum(known) + mean * (len(masses) - len(known))

    def choose(self, masses: list[list[list[float]] | None]) -> int:
        """The width maximising expected tokens per second for a batch whose sequences last reported ``masses``
        (each ``[len(widths)][L]``, or None). Without any report, or after ``EXPLORE`` plain steps in a row
        (they draft nothing, so they report nothing), the smallest tree is tried to hear from the drafter again."""
        n = len(masses)
        if all(m is None for m in masses) or self._plain_run >= EXPLORE:
            w = self.widths[min(1, len(self.widths) - 1)]
        else:
            w = max(self.widths, key=lambda w: self.expected_tokens(masses, self.widths.index(w)) / self.cost(n, w))
        self._plain_run = self._plain_run + 1 if w == 0 else 0
        self.chosen[w] = self.chosen.get(w, 0) + 1
        return w

    def observe(self, w: int, masses: list[list[list[float]]] | None, accepted: list[int], batch: int,
                device_seconds: float | None, wall_seconds: float | None):
        """After a step at width ``w``: calibrate each depth with the acceptance seen against the mass the
        trees gave it (``masses``: the step's reports, None for a step without a draft), and refine the cost
        table with the step's device time and the host's share of its wall time."""
        k = self.widths.index(w)
        if w and masses is not None:  # one update per step (the batch's means): the memory counts steps
            for d in range(self.depth):
                seen = sum(n - 1 > d for n in accepted) / len(accepted)
                given = sum(seq[k][d] for seq in masses) / len(masses)
                self._observed[d] = (1 - EMA) * self._observed[d] + EMA * seen
                self._predicted[d] = (1 - EMA) * self._predicted[d] + EMA * given
            self.calibration = [min(4.0, o / max(p, 1e-6)) for o, p in zip(self._observed, self._predicted)]
        if device_seconds is not None:
            key = (bucket_of(batch), w)
            self.costs[key] = device_seconds if key not in self.costs else (
                (1 - EMA) * self.costs[key] + EMA * device_seconds)
            if wall_seconds is not None:
                self.host_seconds = (1 - EMA) * self.host_seconds + EMA * max(0.0, wall_seconds - device_seconds)

    def report(self) -> dict:
        """The chosen widths (steps per width) and the calibration per depth."""
        return {"tree_sizes": dict(self.chosen), "calibration": [round(c, 4) for c in self.calibration]}
