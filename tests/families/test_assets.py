"""The family matrix's sources: fetched with pip once, and a clear error when they cannot be."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.families import AssetUnavailable
from testkit.families.assets import pip_download


def test_a_failed_download_names_the_package(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: pip finds nothing and says so
    with pytest.raises(AssetUnavailable, match=r"no-such-package-zz==0\.0\.1"):
        pip_download("no-such-package-zz==0.0.1", tmp_path, sdist=False)


def test_the_sdist_holds_the_vocab_files_and_templates_the_matrix_uses() -> None:
    from testkit.families import FAMILIES, assets

    try:
        models = assets.llama_cpp_models()
    except AssetUnavailable as exc:
        pytest.skip(f"llama-cpp-python's sdist could not be fetched: {exc}")
    for family in FAMILIES.values():
        assert (models / "templates" / f"{family.template}.jinja").is_file(), family.template
        if family.vocabulary.kind == "gguf":
            vocab = models / "vocab" / f"ggml-vocab-{family.vocabulary.name}.gguf"
            assert vocab.is_file() and Path(f"{vocab}.inp").is_file(), vocab
    # Only what the matrix needs is kept: no sources, no binaries.
    assert {p.suffix for p in (models / "vocab").iterdir()} <= {".gguf", ".inp", ".out"}
