"""What steps cost here, and the decisions made from it: a forced span, a speculation check,
image work's share of a step. Pure: the lane times its steps and hands the seconds in.

**Forced spans.**
A span of ``k`` forced tokens fed in one forward saves the row ``k`` decode steps, but
what those steps are worth depends on the device and the batch: with every row of the
lane in a span the batch skips whole steps; beside rows that keep decoding it saves only
the row's share of each step (on a CPU, a row's share is most of its cost; on a GPU,
little). The span's forward, and the row's way out of and back into mlx-lm's generator,
cost what their tokens cost on this device. Fixed thresholds got this wrong in both
directions (a forced call 1.33x faster at 1 row, 0.92x at 8 rows on the CPU), so:

- each plain decode step is timed by its width (rows decoding), and each step with spans
  by its extra time over a plain step of that width, per forced token fed;
- spans are taken where the saving exceeds the cost by ``SPAN_MARGIN``. Before anything
  is measured, a forward timed at two lengths at the first span decision (``ForwardCost``)
  prices both: a step of ``w`` rows costs a forward of ``w`` tokens, a span a forward of
  its padded tokens plus a second forward's fixed cost for leaving and rejoining the
  batch. The prior decides only where every decoding row spans; beside rows that keep
  decoding, only measured spans do (leaving and rejoining copies the batch's KV, which
  the prior cannot price). Measured steps replace the prior width by width, and after
  ``WARM_SPANS`` spans their fitted line replaces its span cost. Without a prior the
  shipped thresholds (``min_span``) decide until then.

**Speculation checks** are timed here too (``checked``): a check feeds a row its pending
token and a draft in one forward outside the batch, and pays when the tokens it brings beat
what the row would have decoded in the batch in that time (``acceptance_needed``).

**Image work** (a vision row's own prefill) gets a share of each decode step's measured time
(``image_budget``), spent by ``image_schedule.ImageSchedule``.

A sharded engine's ranks each run the lane and must decide alike, but each times its own
steps: there (``measured=False``) the shipped thresholds decide for good.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Recent observations weigh more: the batch, the prompts and the machine's load move.
FORGET = 0.95
# Span observations before the measured costs decide (the thresholds gather them).
WARM_SPANS = 4
# A span must save this much more than it costs: beside decoding rows on a CPU a span's
# token costs about what the row costs a step, and the difference of two noisy means
# (a step's share of a row) took spans that lost 13% from a fresh process.
SPAN_MARGIN = 1.2
# Speculation checks timed before their measured cost decides (the fixed floor gathers them).
WARM_CHECKS = 4


def min_span(rows: int) -> int:
    """The shortest forced span worth a forward of its own with ``rows`` in the lane,
    before anything is measured.

    Measured on SmolLM2-135M f32, 2 cores: a lone row's 5-token span forward ~120 ms
    and its rejoin ~75 ms against ~70 ms a step, so alone three forced tokens repay them;
    beside a batch, spans of 4-5 tokens lost 13-14% at 4-8 rows while a tool call's
    envelope (8-15 tokens) still won.
    """
    return 3 if rows <= 1 else 8


@dataclass(frozen=True)
class ForwardCost:
    """Seconds a forward of ``n`` tokens takes here: ``fixed + per_token * n`` (timed at
    the lane's first span decision, before any span is measured)."""

    fixed: float
    per_token: float

    def of(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


@dataclass
class _Mean:
    """An exponentially forgetting mean."""

    value: float = 0.0
    weight: float = 0.0

    def add(self, sample: float) -> None:
        self.weight = self.weight * FORGET + 1.0
        self.value += (sample - self.value) / self.weight


@dataclass
class _Line:
    """y = fixed + per_unit * x, fitted by forgetting least squares. With one x seen so
    far (the same span again and again) the line cannot be told from a slope: half of
    its cost is read as fixed, half as per token, so a shorter span is neither always
    taken nor never (and, taken, gives the second x)."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wx, wy, wxx, wxy
    seen: int = 0

    def add(self, x: float, y: float) -> None:
        w, sx, sy, sxx, sxy = (value * FORGET for value in self.sums)
        self.sums = [w + 1, sx + x, sy + y, sxx + x * x, sxy + x * y]
        self.seen += 1

    def fit(self) -> tuple[float, float]:
        w, sx, sy, sxx, sxy = self.sums
        spread = sxx - sx * sx / w
        if spread <= 1e-6 * max(1.0, sxx):
            mean_x, mean_y = sx / w, sy / w
            return mean_y / 2, mean_y / 2 / max(mean_x, 1.0)
        slope = max(0.0, (sxy - sx * sy / w) / spread)
        return max(0.0, (sy - slope * sx) / w), slope


class StepCosts:
    """Measured step, span and check costs, and the decisions they give."""

    def __init__(self, measured: bool = True,
                 prior: ForwardCost | Callable[[], ForwardCost] | None = None) -> None:
        """``prior``: what prices spans before they are measured, or how to time it (called
        at the first span decision: an engine that never meets a span never pays for it)."""
        self.measured = measured  # False: the shipped thresholds decide (ranks must agree)
        self._prior = prior if measured else None
        self._steps: dict[int, _Mean] = {}  # by width: seconds a plain decode step
        self._spans = _Line()  # forced tokens fed -> seconds added to the step
        self._check = _Mean()  # seconds a speculation check (one row, draft and all)
        self._checks = 0
        self.taken = 0  # span sets taken and declined by measured cost (for the report)
        self.declined = 0
        self.version = 0  # moves when the summary would: a report rebuilt only then

    def timed(self, width: int, forced: int, seconds: float) -> None:
        """A decode step of ``width`` rows (none: nothing to learn) that fed ``forced``
        tokens in spans (0: a plain step)."""
        if not width:
            return
        if forced:
            self.spanned(width, forced, seconds)
        else:
            self.stepped(width, seconds)

    def stepped(self, width: int, seconds: float) -> None:
        """A decode step of ``width`` rows with no prefill, span or draft in it."""
        self._steps.setdefault(width, _Mean()).add(seconds)

    def step_near(self, width: int) -> float | None:
        """Seconds a plain decode step of ``width`` rows takes: measured at that width, or
        at the nearest measured one; None before any."""
        measured = [w for w, mean in self._steps.items() if mean.weight >= 1]
        if not measured:
            return None
        return self._steps[min(measured, key=lambda w: (abs(w - width), -w))].value

    def spanned(self, width: int, tokens: int, seconds: float) -> None:
        """A decode step of ``width`` rows that also fed ``tokens`` forced tokens."""
        step = self._steps.get(width)
        if step is not None and step.weight >= 1:
            self._spans.add(tokens, max(0.0, seconds - step.value))
            self.version += 1

    def shortest(self, spans: list[int], width: int, rows: int) -> int:
        """The shortest of these forced spans (two or more tokens each) to feed now, with
        ``width`` rows decoding and ``rows`` held by the lane; above them all: none."""
        if not spans:
            return 2
        warm = self._spans.seen >= WARM_SPANS
        if not self.measured or not (warm or self._prior is not None):
            return min_span(rows)
        if not warm and len(spans) < width:
            # Beside decoding rows a span saves only its rows' share of each step, while
            # leaving and rejoining copies the whole batch's KV (180 ms at 16 rows behind
            # 150 tokens, against a 45 ms step): the prior cannot price that copy, so only
            # measured spans decide here.
            self.declined += 1
            self.version += 1
            return max(spans) + 1
        step = self._step(width)
        if step is None:
            return min_span(rows)
        return 2 if self._pays(spans, width, step) else max(spans) + 1

    @property
    def prior(self) -> ForwardCost | None:
        """The load-time forward's cost, timed at its first use."""
        if callable(self._prior):
            self._prior = self._prior()
        return self._prior

    def _step(self, width: int) -> float | None:
        """A plain step of ``width`` rows: as measured at that width, else as priced by the
        prior (None with neither)."""
        step = self._steps.get(width)
        if step is not None and step.weight >= 1:
            return step.value
        return None if self.prior is None else self.prior.of(width)

    def _span_cost(self, spans: list[int]) -> float:
        """Seconds feeding these spans adds to a step: the fitted line once warm, else the
        prior's forward over the spans' padded tokens and a second fixed cost (the rows
        leave the batch and rejoin it)."""
        if self._spans.seen >= WARM_SPANS or self.prior is None:
            fixed, per_token = self._spans.fit()
            return fixed + per_token * sum(spans)
        return self.prior.fixed + self.prior.of(len(spans) * max(spans))

    def _pays(self, spans: list[int], width: int, step: float) -> bool:
        every_row = len(spans) >= width
        cost = self._span_cost(spans)
        # Every row spans: the batch skips whole steps. Others keep stepping: the rows
        # save only their share of each step.
        saving = min(spans) * step if every_row else self._share(width) * sum(spans)
        taken = saving > SPAN_MARGIN * cost
        self.taken += taken
        self.declined += not taken
        self.version += 1
        return taken

    def _share(self, width: int) -> float:
        """What one row adds to a step of ``width`` rows: the slope of the measured steps
        over their widths (least squares: the difference of two neighbouring means was
        noise enough to read 13 ms a row off a 46 ms step of 10), at most the step's mean
        per row; with fewer than two widths measured, the prior's cost of a token, else the
        step's mean per row."""
        step = self._step(width)
        assert step is not None
        points = [(w, mean.value) for w, mean in self._steps.items() if mean.weight >= 1]
        if len(points) < 2:
            return self.prior.per_token if self.prior is not None else step / width
        mean_w = sum(w for w, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((w - mean_w) ** 2 for w, _ in points)
        slope = sum((w - mean_w) * (t - mean_t) for w, t in points) / spread
        return min(max(0.0, slope), step / width)

    def checked(self, seconds: float) -> None:
        """One speculating row's check (its forward over the pending token and a draft)."""
        self._check.add(seconds)
        self._checks += 1
        if self._checks >= WARM_CHECKS and self._checks % 8 == WARM_CHECKS % 8:
            self.version += 1  # the report shows the figures: refreshed now and then

    def check_floor(self, decoding: int) -> float | None:
        """The mean accepted draft tokens a check must bring to pay, with ``decoding`` other
        rows in the batch's decode; None until checks and the steps are measured.

        Speculating, a lane step is the batch's step without the row plus the check, and
        yields ``decoding + accepted + 1`` tokens; decoding, the step with the row yields
        ``decoding + 1``. It pays when its tokens per second are the higher."""
        with_row = self._steps.get(decoding + 1)
        without = self._steps.get(decoding) if decoding else _Mean(0.0, 1.0)
        if (not self.measured or self._checks < WARM_CHECKS or with_row is None or without is None
                or with_row.weight < 1 or without.weight < 1 or with_row.value <= 0):
            return None
        rows = decoding + 1
        return rows * (without.value + self._check.value) / with_row.value - rows

    def acceptance_needed(self, rows: int, decoding: int, fixed_floor: float) -> float:
        """Accepted tokens a draft must bring to pay, for a speculating row beside
        ``decoding`` rows in the batch (``rows`` in the lane): measured where checks and
        steps are, else ``fixed_floor`` a row (a bigger batch makes a step cheaper)."""
        measured = self.check_floor(decoding)
        if measured is None:
            return fixed_floor * rows
        return max(0.0, measured)

    def image_budget(self, width: int, share: float) -> float | None:
        """Seconds of image work this step earns with ``width`` rows decoding: ``share``
        of such a step's measured time (0.0 before any step is measured: one unit a step);
        None with no row decoding (image work runs to its end)."""
        if not width:
            return None
        step = self.step_near(width)
        return 0.0 if step is None else share * step

    def check_summary(self) -> str:
        """Speculation's measured figures, for ``stats().speedups``."""
        floor = self.check_floor(0)
        if not self.measured:
            return "checks taken at the fixed acceptance floor (sharded: the ranks decide alike)"
        if floor is None:
            return (f"checks taken at the fixed acceptance floor until their cost is measured "
                    f"({min(self._checks, WARM_CHECKS)} of {WARM_CHECKS} checks so far)")
        return (f"checks taken when their accepted tokens pay: a check "
                f"{1e3 * self._check.value:.1f} ms; alone a draft must bring "
                f"{max(0.0, floor):.2f} accepted tokens")

    def summary(self) -> str:
        """The costs as measured, for ``stats().speedups``."""
        if not self.measured:
            return (f"spans taken at >= {min_span(1)} forced tokens alone, >= {min_span(2)} "
                    "in a batch (sharded: the ranks decide alike)")
        prior = self._prior  # not timed here: a report must not run a forward
        if self._spans.seen < WARM_SPANS and prior is not None:
            priced = ("a forward timed at the first span" if callable(prior) else
                      f"a forward timed at the first span ({1e3 * prior.fixed:.1f} ms + "
                      f"{1e3 * prior.per_token:.2f} ms a token)")
            return (f"spans taken when they cost less than the steps they save, priced by "
                    f"{priced} until their cost is measured ({self._spans.seen} of "
                    f"{WARM_SPANS} spans so far); {self.taken} taken, {self.declined} "
                    "declined")
        if self._spans.seen < WARM_SPANS:
            return (f"spans taken at >= {min_span(1)} forced tokens alone, >= {min_span(2)} "
                    f"in a batch until their cost is measured ({self._spans.seen} of "
                    f"{WARM_SPANS} spans so far)")
        fixed, per_token = self._spans.fit()
        steps = ", ".join(f"{w} rows {1e3 * m.value:.1f} ms"
                          for w, m in sorted(self._steps.items())[:4])
        return (f"spans taken when they cost less than the steps they save: a span "
                f"{1e3 * fixed:.1f} ms + {1e3 * per_token:.2f} ms a token, a step {steps}; "
                f"{self.taken} taken, {self.declined} declined")
