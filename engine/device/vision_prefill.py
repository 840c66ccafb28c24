"""Image rows' own prefill: features into the prompt's embeddings, chunk by chunk, then the batch.

A row whose prompt holds images cannot be prefilled by mlx-lm's generator (which reads
token ids only), so it is prefilled here into its own cache, up to the end of its last
image span, and then handed to the generator like a row that resumed a cached prefix:
the text after the image is prefilled and sampled with the batch, and the row decodes
with the others. Text rows beside it are untouched: its cache is its own until it joins.

The work is spread over the lane's steps, one unit a step (an image's tower forward, or
one prefill chunk), first come first served, so the decoding rows keep their pace while
an image row prefills. Cancelling a row drops its job, features and cache at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
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
        self._jobs[row.request_id] = VisionJob(row, cache, done)

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
            with mx.stream(self._stream):
                self._model(mx.array([row.prompt[job.done:end]]), cache=job.cache,
                            input_embeddings=embeds[None])
                mx.eval([layer.state for layer in job.cache])
            job.done = end
        if job.done < job.end:
            return False
        job.features.clear()
        return True

