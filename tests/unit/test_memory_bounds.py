"""The memory formula and its ``auto`` defaults (engine.core.memory): pure arithmetic, no model."""

from __future__ import annotations

import pytest

from engine import EngineConfig
from engine.core.memory import (
    BUFFER_CACHE_MAX,
    BUFFER_CACHE_MIN,
    PREFIX_CAP_MAX,
    STEP_ALLOWANCE,
    GiB,
    MiB,
    physical_memory_bytes,
    resident_bytes,
    resolve_bounds,
)


def _bounds(kv: int | str | None = "auto", prefix: int | str = "auto",
            cache: int | str = "auto", memory: int = 24 * GiB):  # type: ignore[no-untyped-def]
    return resolve_bounds(kv, prefix, cache, memory_bytes=memory, weights_bytes=540 * MiB,
                          resident_at_load=666 * MiB)


def test_the_defaults_are_auto() -> None:
    config = EngineConfig()
    assert (config.kv_budget_bytes, config.prefix_cache_bytes,
            config.buffer_cache_bytes) == ("auto", "auto", "auto")


def test_auto_scales_to_the_memory_left_beside_the_weights() -> None:
    bounds = _bounds()
    assert bounds.kv_budget_bytes == (24 * GiB - 540 * MiB) // 4
    assert bounds.prefix_cache_bytes == bounds.kv_budget_bytes // 8  # 751 MiB here
    assert bounds.buffer_cache_bytes == bounds.kv_budget_bytes // 16
    assert bounds.runtime_bytes == 126 * MiB + STEP_ALLOWANCE
    assert bounds.resident_bound == (540 * MiB + bounds.kv_budget_bytes
                                     + bounds.buffer_cache_bytes + bounds.runtime_bytes)
    small = _bounds(memory=2 * GiB)
    assert small.kv_budget_bytes < bounds.kv_budget_bytes
    assert small.buffer_cache_bytes == BUFFER_CACHE_MIN
    assert _bounds(memory=512 * GiB).prefix_cache_bytes == PREFIX_CAP_MAX
    assert _bounds(memory=512 * GiB).buffer_cache_bytes == BUFFER_CACHE_MAX


def test_on_cpu_the_buffer_cache_stays_at_mlx_cpu_default() -> None:
    bounds = resolve_bounds("auto", "auto", "auto", memory_bytes=24 * GiB,
                            weights_bytes=540 * MiB, resident_at_load=666 * MiB,
                            accelerator=False)
    assert bounds.buffer_cache_bytes == BUFFER_CACHE_MIN == 32 * MiB
    assert bounds.kv_budget_bytes == _bounds().kv_budget_bytes


def test_a_machine_smaller_than_its_weights_still_gets_a_budget() -> None:
    assert _bounds(memory=256 * MiB).kv_budget_bytes == 64 * MiB


def test_explicit_settings_are_kept_and_the_store_fits_in_the_budget() -> None:
    bounds = _bounds(kv=100 * MiB, prefix=10 * MiB, cache=5 * MiB)
    assert (bounds.kv_budget_bytes, bounds.prefix_cache_bytes,
            bounds.buffer_cache_bytes) == (100 * MiB, 10 * MiB, 5 * MiB)
    assert _bounds(kv=100 * MiB, prefix=1 * GiB).prefix_cache_bytes == 100 * MiB
    assert _bounds(prefix=0).prefix_cache_bytes == 0
    # An explicit small budget: the store may fill its idle room (it gives way to rows).
    assert _bounds(kv=8 * MiB).prefix_cache_bytes == 8 * MiB


def test_no_kv_cap_leaves_the_kv_term_out_of_the_bound() -> None:
    bounds = _bounds(kv=None)
    assert bounds.kv_budget_bytes == 0
    assert bounds.prefix_cache_bytes == _bounds().prefix_cache_bytes
    assert bounds.resident_bound == (540 * MiB + bounds.buffer_cache_bytes
                                     + bounds.runtime_bytes)


@pytest.mark.parametrize("field", ["kv_budget_bytes", "prefix_cache_bytes",
                                   "buffer_cache_bytes"])
@pytest.mark.parametrize("bad", ["4", "automatic", -1, 1.5, True])
def test_bad_byte_settings_are_rejected(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: bad})  # type: ignore[arg-type]


def test_the_process_numbers_are_read() -> None:
    assert 0 < resident_bytes() < physical_memory_bytes()


def test_the_resident_sampler_reads_proc_at_most_once_a_period(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy engine publishes its stats every step: the resident set is read from /proc at
    most every quarter second then (a read costs ~50-100 µs), and at once when asked fresh."""
    from engine.core import memory

    reads: list[int] = []

    def counted() -> int:
        reads.append(1)
        return 1000 + len(reads)

    monkeypatch.setattr(memory, "resident_bytes", counted)
    sampler = memory.ResidentSampler(every=3600.0)
    assert sampler.read() == 1001  # the first read always reads
    assert [sampler.read() for _ in range(50)] == [1001] * 50
    assert sampler.read(fresh=True) == 1002
    assert len(reads) == 2
    assert memory.ResidentSampler(every=0.0).read() == 1003
