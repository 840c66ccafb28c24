"""Speculation handed its policy through the lane's seam (``StepProbe.on_lanes``), for tests
that need every drafting row to check its draft, whatever its acceptance record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.device.speedups.speculator import SpeculationPolicy


def every_draft_checked(check: Callable[..., Any] | None = None) -> Callable[[Any], None]:
    """An ``on_lanes`` hook: the batch lane's speculator with no acceptance floor (and
    ``check`` as its row step, to count checks), set on the engine thread before any row.
    Its checks are not priced by measured costs either: once a few were timed, a measured
    floor replaced the zero one, and on a loaded machine no row entered."""

    def hand_in(lanes: Any) -> None:
        speculator = replace(lanes.batch.speculator,
                             policy=SpeculationPolicy(acceptance_floor=0.0),
                             costs=None)
        lanes.batch.speculator = speculator if check is None else replace(speculator,
                                                                          check=check)

    return hand_in
