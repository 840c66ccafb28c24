"""What the loader raises for a model it cannot load, and what it reads from nested configs.

Each failure is an ``OSError`` (missing files) or a ``ValueError`` (corrupt or unsupported
config) naming the model directory and the cause, raised before mlx-lm reads a weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import EngineConfig, InvalidModelError, UnsupportedModelError
from engine.device.loading.architecture import architecture_module, read_model_config
from engine.device.loading.loader import load_model
from engine.models.resolve import config_context_limit
from tests.conftest import own_copy


def _model_dir(tmp_path: Path, config: object) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_a_missing_directory_is_file_not_found_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_model_config(tmp_path / "nowhere")


def test_a_directory_without_config_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        read_model_config(tmp_path)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"hidden_size": 64}',
                                  '{"model_type": ""}'])
def test_a_corrupt_config_is_invalid_model_error(tmp_path: Path, text: str) -> None:
    path = _model_dir(tmp_path, text)
    with pytest.raises(InvalidModelError, match=r"config\.json") as caught:
        read_model_config(path)
    assert isinstance(caught.value, ValueError)
    assert str(path) in str(caught.value)


def test_an_unknown_model_type_is_unsupported_naming_it(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, {"model_type": "no_such_arch"})
    with pytest.raises(UnsupportedModelError, match="no_such_arch") as caught:
        architecture_module(read_model_config(path), path)
    assert isinstance(caught.value, ValueError)
    assert "mlx-lm" in str(caught.value) and str(path) in str(caught.value)


def test_an_architecture_that_exits_on_import_is_unsupported(tmp_path: Path) -> None:
    # mlx-lm's olmo module calls sys.exit(1) when ai2-olmo is missing.
    pytest.importorskip("mlx_lm")
    path = _model_dir(tmp_path, {"model_type": "olmo"})
    with pytest.raises(UnsupportedModelError, match="olmo"):
        architecture_module(read_model_config(path), path)


def test_remapped_model_types_resolve_as_mlx_lm_does(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, {"model_type": "mistral"})  # mlx-lm maps it to llama
    assert architecture_module(read_model_config(path), path).__name__ == "mlx_lm.models.llama"


def test_weights_that_do_not_fit_the_config_are_invalid_model_error(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    path = own_copy(tiny_model_dir, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").unlink()  # a hard link: replace it, never write through it
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(InvalidModelError, match="could not build") as caught:
        load_model(path, EngineConfig())
    assert str(path) in str(caught.value)


def test_context_limit_is_read_from_the_text_config_first(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, {"model_type": "qwen3_5", "max_position_embeddings": 999,
                                 "text_config": {"max_position_embeddings": 262144}})
    assert config_context_limit(path) == 262144


def test_context_limit_reads_gpt2_names_and_ignores_corrupt_configs(tmp_path: Path) -> None:
    assert config_context_limit(_model_dir(tmp_path, {"model_type": "gpt2", "n_ctx": 1024})) == 1024
    (tmp_path / "model" / "config.json").write_text("{broken")
    assert config_context_limit(tmp_path / "model") is None
