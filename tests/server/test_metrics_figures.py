"""/metrics' table of engine figures: each reads a numeric ``EngineStats`` field, under its
own name, and renders that field's value for every served model (no model loaded)."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineStats, SpeedUp
from mlx_providers.server.metrics import COUNTER, ENGINE_FIGURES, GAUGE, ServerMetrics

NUMERIC = {f.name for f in fields(EngineStats) if f.type in ("int", "float", "bool")}


class _Stats:
    """An engine as the collector sees it: only ``stats()``."""

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def test_each_figure_reads_its_own_numeric_field() -> None:
    assert {figure.kind for figure in ENGINE_FIGURES} == {GAUGE, COUNTER}
    assert len({f.name for f in ENGINE_FIGURES}) == len(ENGINE_FIGURES)
    assert len({f.field for f in ENGINE_FIGURES}) == len(ENGINE_FIGURES)
    assert {f.field for f in ENGINE_FIGURES} <= NUMERIC


def test_each_model_reports_each_field_it_names() -> None:
    # Every field a distinct value, so a figure reading the wrong field shows.
    values = {name: i + 1 for i, name in enumerate(sorted(NUMERIC - {"loaded"}))}
    stats = EngineStats(**values, loaded=True,  # type: ignore[arg-type]
                        speedups=(SpeedUp("fast_forward", True, "trims"),))
    engines: dict[str, Engine] = {"a": _Stats(stats), "b": _Stats(EngineStats())}  # type: ignore[dict-item]
    text = ServerMetrics(lambda: engines).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for figure in ENGINE_FIGURES:
        family = families[figure.name]
        assert family.type == ("gauge" if figure.kind is GAUGE else "counter")
        assert family.documentation == figure.help
        got = {s.labels["model"]: s.value for s in family.samples
               if not s.name.endswith("_created")}
        assert got == {"a": float(getattr(stats, figure.field)), "b": 0.0}, figure.name
    speedup = families["mlx_engine_speedup"].samples
    assert [(s.labels["model"], s.labels["speedup"], s.value) for s in speedup] == [
        ("a", "fast_forward", 1.0)]
