"""Image rows' own prefill: features into the prompt's embeddings, chunk by chunk, then the batch.

A row whose prompt holds images cannot be prefilled by mlx-lm's generator (which reads
token ids only), so it is prefilled here into its own cache, up to the end of its last
image span, and then handed to the generator like a row that resumed a cached prefix:
the text after the image is prefilled and sampled with the batch, and the row decodes
with the others. Text rows beside it are untouched: its cache is its own until it joins.

The work is spread over the lane's steps, one unit a step (an image's tower forward, or
one prefill chunk), first come first served, so the decoding rows keep their pace while
an image row prefills. Cancelling a row drops its job, features and cache at once.

Where a family places image tokens on a grid of positions (M-RoPE: Qwen-VL), the text
after the images sits ``LaneRow.position_shift`` positions away from its index, which the
batch's offsets cannot say. The row is prefilled at its grid positions, and then its cached
keys are turned back by that shift, so every later token, prefilled or decoded in the
batch, is at its own offset: the same attention as at its true position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine.device.batch_row import BatchRow
from engine.device.vision import VisionTower


@dataclass(eq=False)
class VisionJob:
    """A row's image prefill in progress: its cache holds ``prompt[:done]``."""

    row: BatchRow
    cache: list[Any]
    done: int
    features: dict[str, mx.array] = field(default_factory=dict)
    frame: int = 0  # positions the cache's keys are turned back by (M-RoPE)
    positions: np.ndarray | None = None  # (3, prompt) grid positions (M-RoPE)

    @property
    def end(self) -> int:
        """Prefilled up to here; the rest is plain text, which the generator prefills."""
        return self.row.row.vision_end


class VisionPrefill:
    """Image rows waiting for (or in) their own prefill, advanced one unit per step."""

    def __init__(self, model: Any, stream: Any, tower: VisionTower, chunk: int,
                 max_kv_size: int | None) -> None:
        self._model = model
        self._stream = stream
        self.tower = tower
        self._chunk = max(1, chunk)
        self._max_kv_size = max_kv_size
        self._jobs: dict[int, VisionJob] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, row: BatchRow, cache: list[Any] | None, done: int) -> None:
        """Queue ``row``, resuming ``cache`` (which holds ``prompt[:done]``) if given."""
        if cache is None:
            cache, done = make_prompt_cache(self._model, self._max_kv_size), 0
        job = VisionJob(row, cache, done)
        if self.tower.grid_positions:
            job.positions = grid_positions(len(row.prompt), row.row.images)
            # A resumed cache came from a row keyed by the same shift (``image_keys``).
            job.frame = row.row.position_shift if done else 0
        self._jobs[row.request_id] = job

    def drop(self, request_id: int) -> bool:
        """Forget a row's job (cancelled or failed): its features and cache go with it."""
        return self._jobs.pop(request_id, None) is not None

    def clear(self) -> list[int]:
        dropped = list(self._jobs)
        self._jobs.clear()
        return dropped

    def advance(self) -> tuple[list[VisionJob], dict[int, BaseException]]:
        """One unit of work on the oldest job: (jobs now prefilled, rows that failed)."""
        if not self._jobs:
            return [], {}
        job = next(iter(self._jobs.values()))
        try:
            finished = self._advance(job)
        except Exception as exc:  # this row's image or prefill failed: it ends alone
            self._jobs.pop(job.row.request_id, None)
            return [], {job.row.request_id: exc}
        if not finished:
            return [], {}
        self._jobs.pop(job.row.request_id, None)
        return [job], {}

    def _advance(self, job: VisionJob) -> bool:
        row = job.row.row
        for image in row.images:  # the tower first, one image a step
            if image.start + image.length > job.done and image.key not in job.features:
                job.features[image.key] = self.tower.features(image)
                return False
        end = min(job.done + self._chunk, job.end)
        if end > job.done:
            embeds = self.tower.embeddings(row.prompt, job.done, end, row.images,
                                           job.features)
            positions = (None if job.positions is None
                         else job.positions[:, job.done:end] - job.frame)
            with mx.stream(self._stream):
                self.tower.prefill(job.cache, row.prompt[job.done:end], embeds, positions)
            job.done = end
        if job.done < job.end:
            return False
        if job.positions is not None:
            with mx.stream(self._stream):
                self.tower.shift_positions(job.cache, row.position_shift - job.frame)
        job.features.clear()
        return True


def grid_positions(length: int, images: tuple[Any, ...]) -> np.ndarray:
    """(3, length) M-RoPE positions (time, row, column) of a prompt: text tokens count up
    on all three; an image's tokens share its first position in time and take their row
    and column on its grid; the text after it resumes past the grid's longer side."""
    positions = np.empty((3, length), np.int64)
    at, next_position = 0, 0
    for image in sorted(images, key=lambda i: i.start):
        text = image.start - at
        positions[:, at:image.start] = np.arange(next_position, next_position + text)
        next_position += text
        rows, columns = image.grid
        index = np.arange(image.length)
        positions[0, image.start:image.start + image.length] = next_position
        positions[1, image.start:image.start + image.length] = next_position + index // columns
        positions[2, image.start:image.start + image.length] = next_position + index % columns
        next_position += max(rows, columns)
        at = image.start + image.length
    positions[:, at:] = np.arange(next_position, next_position + length - at)
    return positions

