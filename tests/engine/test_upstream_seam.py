"""The seam to upstream internals (``engine.device.upstream``): every name it relies on is
there on the pinned versions (the canary), a missing one fails the load with one error naming
it, and the lane's overrides sit on its own generator's instances, never on mlx-lm's classes.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from engine import Engine, EngineConfig, SamplingParams, TextRequest
from engine.device.upstream import required
from engine.device.upstream.batches import LaneGenerationBatch, LanePromptBatch, install
from engine.device.upstream.required import (
    REQUIRED,
    VISION_REQUIRED,
    Reach,
    check_upstream,
    missing,
)
from engine.errors import UnsupportedUpstreamError

ROOT = Path(__file__).resolve().parents[2]
SEAM = ROOT / "engine" / "device" / "upstream"


def test_every_name_the_seam_relies_on_is_in_the_pinned_versions() -> None:
    """The canary: run against a newer mlx-lm (CI's upstream job), it names what moved."""
    assert missing() == []
    check_upstream()
    if importlib.util.find_spec("mlx_vlm") is not None:
        assert missing(VISION_REQUIRED) == []


def test_a_missing_name_is_named_with_the_versions() -> None:
    gone = [Reach("mlx-lm", "mlx_lm.generate.GenerationBatch._no_such_field", "a test", True),
            Reach("mlx", "mlx.core.fast.no_such_op", "another test")]
    assert missing(gone) == gone
    error = required.unsupported(gone)
    text = str(error)
    assert "mlx_lm.generate.GenerationBatch._no_such_field (a test)" in text
    assert "mlx.core.fast.no_such_op (another test)" in text
    assert f"mlx-lm {required.version('mlx-lm')}" in text
    assert f"mlx-lm{required.supported('mlx-lm')}" in text and "0.33" in text
    assert error.names == [reach.path for reach in gone]


def test_an_unsupported_upstream_fails_the_load_by_name(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = (Reach("mlx-lm", "mlx_lm.generate.GenerationBatch._renamed", "the decoding step",
                  True),)
    monkeypatch.setattr(required, "_checked", lambda: gone)
    eng = Engine(tiny_model_dir, EngineConfig())
    with pytest.raises(UnsupportedUpstreamError) as raised:
        eng.start()
    assert "GenerationBatch._renamed (the decoding step)" in str(raised.value)
    eng.close()


def test_a_generator_without_its_fields_is_refused_by_name(tiny_model_dir: Path) -> None:
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
    generator = BatchGenerator(model)
    del generator._uid_count
    with pytest.raises(UnsupportedUpstreamError, match=r"BatchGenerator\._uid_count"):
        install(generator, masks=None)  # type: ignore[arg-type]


def test_overrides_sit_on_the_lanes_instances_not_on_mlx_lms_classes(
        make_engine: Callable[..., Engine], tiny_model_dir: Path) -> None:
    """After an engine ran prefill and decode, mlx-lm's own classes are as shipped and a
    generator made elsewhere in the process gets mlx-lm's batches."""
    steps = (GenerationBatch._step, PromptProcessingBatch.prompt,
             PromptProcessingBatch.generate)
    eng = make_engine(max_batch=4)
    eng.submit(TextRequest("hello", SamplingParams(max_tokens=4))).result(timeout=60)
    generator = eng._runtime.composition.built.lanes.batch.generator
    assert type(generator._generation_batch) is LaneGenerationBatch
    assert type(generator._prompt_batch) is LanePromptBatch
    assert (GenerationBatch._step, PromptProcessingBatch.prompt,
            PromptProcessingBatch.generate) == steps
    from mlx_lm import load

    other = BatchGenerator(load(str(tiny_model_dir))[0])
    assert type(other._generation_batch) is GenerationBatch


_PRIVATE = {"_generation_batch", "_prompt_batch", "_uid_count", "_next_tokens",
            "_next_logprobs", "_token_context", "_current_tokens", "_matchers"}
_BATCHES = {"GenerationBatch", "PromptProcessingBatch"}


def _is_mx_fast(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "fast" and isinstance(
        node.value, ast.Name) and node.value.id == "mx"


def _reaches(path: Path) -> set[str]:
    """What a module does that only the seam may: mlx-lm's private batch fields, its batch
    classes, ``mx.fast``'s functions replaced."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in _PRIVATE:
            found.add(node.attr)
        elif isinstance(node, ast.Name) and node.id in _BATCHES:
            found.add(node.id)
        elif isinstance(node, ast.ImportFrom) and any(a.name in _BATCHES for a in node.names):
            found.add("imports mlx-lm's batch classes")
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and _is_mx_fast(t.value) for t in node.targets):
            found.add("assigns to mx.fast")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and node.args and _is_mx_fast(node.args[0])):
            found.add("setattr(mx.fast, ...)")
    return found


def test_only_the_seam_reaches_into_mlx_lms_batches() -> None:
    """No engine module outside the seam touches the generator's private batches, subclasses
    them, or replaces ``mx.fast``'s functions; the seam itself does (the check can fail)."""
    offenders = {str(path.relative_to(ROOT)): sorted(_reaches(path))
                 for path in (ROOT / "engine").rglob("*.py")
                 if SEAM not in path.parents and _reaches(path)}
    assert offenders == {}
    assert _reaches(SEAM / "batches.py") and _reaches(SEAM / "decoding_batch.py")
    assert {reach.package for reach in REQUIRED} == {"mlx", "mlx-lm"}
