"""StepProbe: a test seam on the engine thread's loop (injected step faults, turn reports).

Tests and diagnostics pass one to ``Engine(model, config, probe=StepProbe())``; it is not a
production feature. An engine without a probe pays one ``is None`` check per lane step and
one per turn of its loop. Pure: it never touches the model and imports no mlx.

- ``fail_next(error, steps=1)`` and ``fail_always(error)`` make the next lane steps raise
  ``error`` where a model step raises (just before ``Lane.step``), so the engine's own
  containment runs unchanged: the rows in that lane fail with ``EngineError`` whose
  ``__cause__`` is ``error``, and after ``max_consecutive_step_failures`` failed steps in a
  row the engine dies (``EngineDeadError`` for every waiter and every later submit).
- ``slow_steps(seconds)`` makes every lane step take at least that long longer (a slow
  model, for timing tests of callers such as the server); ``slow_steps(0)`` undoes it.
- ``on_turn(report)``, if given, runs on the engine thread at the end of every turn of the
  loop with a ``TurnReport``. It must be quick and must not raise: an exception there kills
  the engine, as any bug in the loop would.
- ``on_step(lane)``, if given, runs on the thread that steps a lane, just before the step
  (after the delay, before an armed fault): which thread does the model work, which lanes
  step. The same rules as ``on_turn``.
- ``on_embed(texts)``, if given, runs on the engine thread just before an embedding batch
  is encoded, with the batch's texts. It may block: the engine thread then waits as it
  would for a slow encoder (tests hold a running batch this way). Raising fails that
  batch's requests, as an encoder error would.
- ``on_model(stage)``, if given, runs on the engine thread with ``"loading"`` just before
  the chat model loads (the first time, and again after keep_alive unloaded it) and
  ``"unloading"`` just before an idle engine releases it. It may block: tests hold a
  reload this way to submit or cancel during it. Raising there kills the engine, as a
  failed load does.
- ``on_lanes(lanes)``, if given, runs on the engine thread each time the chat model's
  lanes are built (the first load, and each reload), before any row runs, with the
  engine's ``engine.device.loading.loader.Lanes``: tests hand a lane collaborators built with
  their own policies there (``lanes.batch.speculator``), on the thread that owns the lane.
  Raising there kills the engine, as a failed load does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.core.stats import EngineStats


@dataclass(frozen=True)
class TurnReport:
    """One turn of the engine loop, as a probe sees it."""

    admitted: tuple[int, ...]  # request ids started this turn, batch lane first, in order
    kv_bytes_projected: int  # worst-case KV bytes of the running rows right after admission
    prefix_bytes: int  # bytes the prefix cache held right after admission
    stats: EngineStats  # a snapshot at the end of the turn, after the lane steps
    # At the end of the turn: rows each lane holds ("batch", "serial"), and the KV bytes
    # held by the batch lane's mlx-lm generator (prompts waiting, prefilling, decoding;
    # rows out of it to fast-forward or speculate are not counted). Rows that ended or
    # were cancelled must be gone from both.
    lane_rows: Mapping[str, int] = field(default_factory=dict)
    batch_kv_bytes: int = 0


class StepProbe:
    """Injects model-step faults and observes every turn; thread-safe to arm from anywhere."""

    def __init__(self, on_turn: Callable[[TurnReport], None] | None = None, *,
                 on_step: Callable[[str], None] | None = None,
                 on_embed: Callable[[list[str]], None] | None = None,
                 on_model: Callable[[str], None] | None = None,
                 on_lanes: Callable[[Any], None] | None = None) -> None:
        for name, hook in (("on_turn", on_turn), ("on_step", on_step), ("on_embed", on_embed),
                           ("on_model", on_model), ("on_lanes", on_lanes)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be callable, got {type(hook).__name__}")
        self.on_turn = on_turn
        self.on_step = on_step
        self.on_embed = on_embed
        self.on_model = on_model
        self.on_lanes = on_lanes
        self._lock = threading.Lock()
        self._error: Exception | None = None
        self._remaining = 0  # steps still to fail; -1: every step
        self._raised = 0
        self._delay = 0.0

    def fail_next(self, error: Exception, steps: int = 1) -> None:
        """Make the next ``steps`` lane steps raise ``error``."""
        _check_error(error)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        with self._lock:
            self._error, self._remaining = error, steps

    def fail_always(self, error: Exception) -> None:
        """Make every lane step raise ``error`` until ``stop_failing()``."""
        _check_error(error)
        with self._lock:
            self._error, self._remaining = error, -1

    def stop_failing(self) -> None:
        with self._lock:
            self._error, self._remaining = None, 0

    def slow_steps(self, seconds: float) -> None:
        """Sleep ``seconds`` before every lane step (0 = full speed again)."""
        if (not isinstance(seconds, int | float) or isinstance(seconds, bool)
                or not 0 <= seconds < float("inf")):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        with self._lock:
            self._delay = float(seconds)

    @property
    def faults_raised(self) -> int:
        """Lane steps this probe has made fail."""
        with self._lock:
            return self._raised

    # ----- called by the engine thread -----------------------------------------------------

    def before_step(self, lane: str) -> None:
        """Sleep the set delay, then raise the armed fault, if any (``lane`` is ``"batch"``
        or ``"serial"``)."""
        with self._lock:
            delay = self._delay
        if delay:
            time.sleep(delay)
        if self.on_step is not None:
            self.on_step(lane)
        with self._lock:
            error = self._error
            if error is None:
                return
            if self._remaining > 0:
                self._remaining -= 1
                if self._remaining == 0:
                    self._error = None
            self._raised += 1
        raise error

    def turn_ended(self, report: TurnReport) -> None:
        if self.on_turn is not None:
            self.on_turn(report)

    def before_embed(self, texts: list[str]) -> None:
        """An embedding batch of ``texts`` is about to be encoded (engine thread)."""
        if self.on_embed is not None:
            self.on_embed(texts)

    def model_stage(self, stage: str) -> None:
        """The chat model is about to be ``"loading"`` or ``"unloading"`` (engine thread)."""
        if self.on_model is not None:
            self.on_model(stage)

    def lanes_built(self, lanes: Any) -> None:
        """The chat model's lanes were just built; no row has run on them (engine thread)."""
        if self.on_lanes is not None:
            self.on_lanes(lanes)


def _check_error(error: object) -> None:
    if not isinstance(error, Exception):
        raise TypeError(f"error must be an Exception instance, got {type(error).__name__}")


__all__ = ["StepProbe", "TurnReport"]
