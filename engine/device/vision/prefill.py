"""Image rows' own prefill: features into the prompt's embeddings, chunk by chunk, then the batch.

A row whose prompt holds images cannot be prefilled by mlx-lm's generator (which reads
token ids only), so it is prefilled here into its own cache, up to the end of its last
image span, and then handed to the generator like a row that resumed a cached prefix:
the text after the image is prefilled and sampled with the batch, and the row decodes
with the others. Text rows beside it are untouched: its cache is its own until it joins.

The work is spread over the lane's steps in units (one block of an image's tower, or one
prefill chunk), first come first served, when ``engine.core.image_schedule`` says (a
share of each decode step's measured time, ``EngineConfig.vision_step_share``). Cancelling
a row drops its job, features and cache at once.

The tower is built (mlx-vlm imported, its weights read) by the first unit of work that
needs it, on the engine thread: until an image row comes, the vision stack costs nothing.
Where it cannot be imported, each image row fails alone with an ``InvalidRequestError``
naming its part and the ``vision`` extra; text rows are untouched.

Where a family places image tokens on a grid of positions (M-RoPE: Qwen-VL), the text
after the images sits ``LaneRow.position_shift`` positions away from its index, which the
batch's offsets cannot say. The row is prefilled at its grid positions, and then its cached
keys are turned back by that shift, so every later token, prefilled or decoded in the
batch, is at its own offset: the same attention as at its true position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine.core.image_schedule import ImageSchedule
from engine.device.adapters.row_adapters import rows_of
from engine.device.rows.batch_row import BatchRow
from engine.device.vision.tower import FeatureRun, VisionTower
from engine.errors import InvalidRequestError
from engine.requests.inbound.prompts import PromptImage


@dataclass(eq=False)
class VisionJob:
    """A row's image prefill in progress: its cache holds ``prompt[:done]``."""

    row: BatchRow
    cache: list[Any]
    done: int
    features: dict[str, mx.array] = field(default_factory=dict)
    runs: dict[str, FeatureRun] = field(default_factory=dict)  # towers in progress
    frame: int = 0  # positions the cache's keys are turned back by (M-RoPE)
    positions: np.ndarray | None = None  # (3, prompt) grid positions (M-RoPE)

    @property
    def end(self) -> int:
        """Prefilled up to here; the rest is plain text, which the generator prefills."""
        return self.row.row.vision_end


class VisionPrefill:
    """Image rows waiting for (or in) their own prefill, advanced by the credit each step
    earns (``advance``)."""

    def __init__(self, model: Any, stream: Any, tower: Callable[[], VisionTower],
                 chunk: int, max_kv_size: int | None, *, grid_positions: bool = False,
                 ) -> None:
        self._model = model
        self._stream = stream
        self._build = tower  # builds the tower: called once, by the first image's work
        self.built: VisionTower | None = None
        self.grid_positions = grid_positions  # the family places images on a grid (M-RoPE)
        self._chunk = max(1, chunk)
        self._max_kv_size = max_kv_size
        self._jobs: dict[int, VisionJob] = {}
        self._token_seconds = 0.0  # a prefill token's cost, as last measured
        self.schedule = ImageSchedule()  # when units run (the policy, in core)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, row: BatchRow, cache: list[Any] | None, done: int,
            frame: int | None = None) -> None:
        """Queue ``row``, resuming ``cache`` (which holds ``prompt[:done]``, its keys kept at
        shift ``frame``: the row's own where None) if given."""
        self._jobs[row.request_id] = self.job(row, cache, done, frame)

    def job(self, row: BatchRow, cache: list[Any] | None, done: int,
            frame: int | None = None) -> VisionJob:
        """A row's image prefill, not queued: for a lane that runs it itself (``work``),
        as the serial lane does for a row that runs alone."""
        if cache is None:
            cache, done = make_prompt_cache(self._model, self._max_kv_size), 0
        job = VisionJob(row, cache, done)
        if self.grid_positions:
            job.positions = grid_positions(len(row.prompt), row.row.images)
            # A resumed cache is kept at the shift it was keyed by (``reuse_key``): the
            # row's own, or an earlier turn's (``BatchRow.resume_frames``).
            job.frame = (row.row.position_shift if frame is None else frame) if done else 0
        return job

    def tower(self, image: PromptImage) -> VisionTower:
        """The tower, built on first use; a missing vision stack refuses ``image``'s part."""
        if self.built is None:
            try:
                self.built = self._build()
            except ImportError as exc:  # mlx-vlm (or what it imports) is not installed
                raise InvalidRequestError(
                    f"{image.at}: reading this model's images needs the vision extra "
                    f"(mlx-vlm), which could not be imported ({exc}): pip install "
                    "'mlx-providers[vision]'", image.at) from exc
        return self.built

    def drop(self, request_id: int) -> bool:
        """Forget a row's job (cancelled or failed): its features and cache go with it."""
        return self._jobs.pop(request_id, None) is not None

    def clear(self) -> list[int]:
        dropped = list(self._jobs)
        self._jobs.clear()
        return dropped

    def advance(self, budget: float | None,
                ) -> tuple[list[VisionJob], dict[int, BaseException]]:
        """Units of work on the oldest jobs, for this step's ``budget`` seconds
        (``StepCosts.image_budget``): (jobs now prefilled, rows that failed)."""
        done: list[VisionJob] = []
        failed: dict[int, BaseException] = {}
        schedule = self.schedule
        schedule.earn(budget)
        while self._jobs and schedule.may_run():
            job = next(iter(self._jobs.values()))
            started = time.perf_counter()
            try:
                finished = self.work(job, schedule.left())
            except Exception as exc:  # this row's image or prefill failed: it ends alone
                self._jobs.pop(job.row.request_id, None)
                failed[job.row.request_id] = exc
                finished = False
            schedule.spent(time.perf_counter() - started)
            if finished:
                self._jobs.pop(job.row.request_id, None)
                done.append(job)
        if not self._jobs:
            schedule.idle()
        return done, failed

    def work(self, job: VisionJob, left: float | None = None) -> bool:
        """One unit of ``job``: a block of the tower, or a prefill chunk sized to ``left``
        seconds (None: the lane's chunk); True once its cache holds every image."""
        row = job.row.row
        tower = self.tower(row.images[0])
        for image in row.images:  # the towers first, a block a unit
            if image.start + image.length > job.done and image.key not in job.features:
                run = job.runs.get(image.key)
                if run is None:
                    run = job.runs[image.key] = tower.start(image)
                found = run.step()
                if found is not None:
                    job.features[image.key] = found
                    del job.runs[image.key]
                return False
        chunk = ImageSchedule.chunk(self._chunk, left, self._token_seconds)
        end = tower.chunk_end(row.images, min(job.done + chunk, job.end))
        if end > job.done:
            embeds = tower.embeddings(row.prompt, job.done, end, row.images,
                                           job.features)
            positions = (None if job.positions is None
                         else job.positions[:, job.done:end] - job.frame)
            started = time.perf_counter()
            with mx.stream(self._stream), rows_of(self._model, [job.row.slot]):
                tower.prefill(job.cache, row.prompt[job.done:end], embeds, positions,
                              tower.deepstack(row.prompt, job.done, end, row.images,
                                              job.features))
            self._token_seconds = (time.perf_counter() - started) / (end - job.done)
            job.done = end
        if job.done < job.end:
            return False
        if job.positions is not None:
            with mx.stream(self._stream):
                tower.shift_positions(job.cache, row.position_shift - job.frame)
        job.features.clear()
        job.runs.clear()
        return True


def grid_positions(length: int, images: tuple[Any, ...]) -> np.ndarray:
    """(3, length) M-RoPE positions (time, row, column) of a prompt: text tokens count up
    on all three; an image's tokens share its first position in time and take their row
    and column on its grid (a video block's groups count up in time); the text after it
    resumes past the grid's longest side."""
    positions = np.empty((3, length), np.int64)
    at, next_position = 0, 0
    for image in sorted(images, key=lambda i: i.start):
        text = image.start - at
        positions[:, at:image.start] = np.arange(next_position, next_position + text)
        next_position += text
        rows, columns = image.grid
        frames = getattr(image, "frames", 1)  # a video block's temporal groups
        index = np.arange(image.length)
        positions[0, image.start:image.start + image.length] = (
            next_position + index // (rows * columns))
        positions[1, image.start:image.start + image.length] = (
            next_position + (index // columns) % rows)
        positions[2, image.start:image.start + image.length] = next_position + index % columns
        next_position += max(frames, rows, columns)
        at = image.start + image.length
    positions[:, at:] = np.arange(next_position, next_position + length - at)
    return positions

