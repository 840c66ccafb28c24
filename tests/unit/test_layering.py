"""The dependency direction (docs/architecture.md), enforced by parsing imports (no module
is run).

Rules, one test each:
(a) nothing under engine/ imports a framework (langchain*, llama_index*) or mlx_providers;
(b) only engine/device/ imports mlx or mlx_lm, at module level or inside functions;
(c) the pure modules import nothing from engine.device, directly or through other engine
    modules, so they stay testable without a model;
(d) mlx_providers uses only the engine's public API (``engine`` itself, names in its
    ``__all__``), never ``engine.<submodule>``, mlx or mlx_lm;
(e) engine/__init__.py imports engine._platform.blas first and activates it before
    anything else is imported;
(f) every name engine/__init__.py's ``__all__`` promises exists;
(g) mlx_providers/server (HTTP) imports no framework: neither langchain* nor llama_index*,
    nor the adapter modules that do;
(h) the subpackages point one way, a row for each: device (mlx) imports no models,
    distributed, embedding or facade module; models, embedding and distributed may use
    device, never the reverse, and none of them the runtime or the facade above it (the
    runtime, the thread and its composition, imports everything but the facade); request
    preparation (engine/requests) imports nothing of the loop (engine/core); inside it, what
    comes in (inbound) imports neither the constraints nor what goes out (outbound), and
    those two import neither each other nor the preparation that joins them (prepare.py);
(i) no module imports another module's private (``_name``) names, and bench/ and
    examples/ import nothing from tests/;
(j) the unit tier (tests/unit) reaches no mlx or mlx_lm through what it imports at module
    level, transitively through first-party modules: its runtime guard (conftest.py) sees
    nothing once any collected file has loaded mlx, so this rule is the one that holds.
"""

from __future__ import annotations

import ast
import importlib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"
DEVICE = ENGINE / "device"
FRAMEWORKS = ("langchain", "llama_index", "mlx_providers")  # langchain* covers langchain_core
MLX = ("mlx", "mlx_lm")
# The modules that must stay importable and testable without a model: the loop's pure parts
# (engine/core), request preparation (engine/requests), and these (engine/<name>.py).
PURE_PACKAGES = ("core", "requests")
PURE = ("errors", "config", "embedding/request", "embedding/batcher",
        "distributed/protocol",
        *sorted(p.relative_to(ENGINE).with_suffix("").as_posix() for pkg in PURE_PACKAGES
                for p in (ENGINE / pkg).rglob("*.py") if p.stem != "__init__"))
# No exception to (b): engine/_platform/blas.py must run before mlx.core is loaded, and it
# only locates libmlx as a file (its GOT, ``"mlx.core" in sys.modules``); it has no
# ``import mlx`` statement, so engine/_platform is held to the same rule as the rest.
MLX_ALLOWED = (DEVICE,)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def imports_of(path: Path) -> frozenset[str]:
    """Every module a file imports anywhere in it (ast.walk: functions and TYPE_CHECKING too).

    Relative imports are resolved; ``from a import b`` gives ``a``, and ``a.b`` as well when
    ``b`` is a submodule file of ``a`` (so ``from engine import device`` is seen).
    ``importlib.import_module("x")`` and ``__import__("x")`` with a literal name count too.
    """
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names
                         if source_of(f"{module}.{alias.name}") is not None)
        elif isinstance(node, ast.Call) and node.args and _is_dynamic_import(node.func):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
    return frozenset(names)


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def source_of(module: str) -> Path | None:
    """The file of a first-party module (engine.*, mlx_providers.*), or None."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def top_levels(names: frozenset[str], roots: tuple[str, ...]) -> set[str]:
    return {n for n in names if n.split(".")[0].startswith(roots)}


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


ENGINE_FILES = python_files("engine")
ADAPTER_FILES = python_files("mlx_providers")
SERVER_FILES = sorted((ROOT / "mlx_providers" / "server").rglob("*.py"))
FRAMEWORK_FACES = ("mlx_providers.langchain", "mlx_providers.llama_index",
                   "mlx_providers._langchain_inbound", "mlx_providers._langchain_outbound",
                   "mlx_providers._langchain_structured", "mlx_providers._llama_index")


def test_the_walk_finds_every_layer() -> None:
    """Guard against an empty parametrization passing silently after a move."""
    found = {rel(p) for p in ENGINE_FILES}
    for expected in ("engine/__init__.py", "engine/engine.py", "engine/device/lane/batch_lane.py",
                     "engine/models/resolve.py", "engine/_platform/blas.py"):
        assert expected in found
    assert any(p.name == "langchain.py" for p in ADAPTER_FILES)


@pytest.mark.parametrize("path", ENGINE_FILES, ids=rel)
def test_a_engine_knows_nothing_of_the_frameworks(path: Path) -> None:
    bad = top_levels(imports_of(path), FRAMEWORKS)
    assert not bad, f"{rel(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", ENGINE_FILES, ids=rel)
def test_b_only_engine_device_imports_mlx(path: Path) -> None:
    if any(path.is_relative_to(allowed) for allowed in MLX_ALLOWED):
        return
    bad = {n for n in imports_of(path) if n.split(".")[0] in MLX}
    assert not bad, f"{rel(path)} imports {sorted(bad)}: only engine/device/ may import mlx"


def test_b_engine_device_is_where_mlx_lives() -> None:
    """The exception above covers real code: some device module does import mlx."""
    assert any(n.split(".")[0] in MLX
               for p in DEVICE.rglob("*.py") for n in imports_of(p))


def _imports_device(names: frozenset[str]) -> set[str]:
    return {n for n in names if n == "engine.device" or n.startswith("engine.device.")}


def test_c_the_pure_packages_are_found() -> None:
    """Guard against an empty PURE after a move: the loop and request preparation are in it."""
    for expected in ("core/scheduler", "core/update", "requests/prepare",
                     "requests/inbound/tool_specs", "requests/constraints/forced_calls",
                     "requests/outbound/row_channels"):
        assert expected in PURE


@pytest.mark.parametrize("name", PURE)
def test_c_pure_modules_import_nothing_from_engine_device(name: str) -> None:
    path = ENGINE / f"{name}.py"
    assert path.is_file(), f"pure module engine/{name}.py is gone: update PURE"
    bad = _imports_device(imports_of(path))
    assert not bad, f"engine/{name}.py imports {sorted(bad)}; it must stay testable without mlx"


@pytest.mark.parametrize("name", PURE)
def test_c_pure_modules_reach_no_engine_device_through_other_modules(name: str) -> None:
    """The engine modules a pure module imports, transitively, import no engine.device."""
    start = "engine." + name.replace("/", ".")
    via: dict[str, str] = {start: start}
    todo = [start]
    while todo:
        current = todo.pop()
        source = source_of(current)
        assert source is not None, current
        bad = _imports_device(imports_of(source))
        chain = [current]
        while chain[-1] != start:
            chain.append(via[chain[-1]])
        assert not bad, f"engine/{name}.py reaches {sorted(bad)} via {' <- '.join(chain)}"
        for imported in sorted(imports_of(source)):
            if imported.split(".")[0] == "engine" and imported not in via:
                via[imported] = current
                todo.append(imported)


@pytest.mark.parametrize("path", ADAPTER_FILES, ids=rel)
def test_d_adapters_use_only_the_engine_public_api(path: Path) -> None:
    names = imports_of(path)
    private = {n for n in names if n.startswith("engine.")}
    direct = {n for n in names if n.split(".")[0] in MLX}
    assert not private and not direct, f"{rel(path)} imports {sorted(private | direct)}"


@pytest.mark.parametrize("path", ADAPTER_FILES, ids=rel)
def test_d_adapters_import_only_names_engine_exports(path: Path) -> None:
    public = set(engine_all())
    tree = ast.parse(path.read_text(), str(path))
    used = {alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "engine"
            for alias in node.names}
    assert used <= public, f"{rel(path)} imports {sorted(used - public)}, not in engine.__all__"


def test_e_engine_init_loads_blas_before_anything_imports_mlx() -> None:
    tree = ast.parse((ENGINE / "__init__.py").read_text())
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import)]
    first_import = imports[0]
    assert isinstance(first_import, ast.ImportFrom)
    assert first_import.module == "engine._platform.blas"
    # ... and the fast BLAS is activated before the next import can bring mlx in.
    after = tree.body[tree.body.index(first_import) + 1]
    assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Call)
    assert isinstance(after.value.func, ast.Name)
    assert after.value.func.id == "activate_fast_blas"
    assert "activate_fast_blas" in {alias.asname or alias.name for alias in first_import.names}


@cache
def engine_all() -> tuple[str, ...]:
    tree = ast.parse((ENGINE / "__init__.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
            value = ast.literal_eval(node.value)
            return tuple(value)
    raise AssertionError("engine/__init__.py has no literal __all__")


def test_f_engine_all_lists_each_name_once() -> None:
    names = engine_all()
    assert names and len(names) == len(set(names))


@pytest.mark.parametrize("name", engine_all())
def test_f_every_name_in_engine_all_exists(name: str) -> None:
    engine = importlib.import_module("engine")
    assert hasattr(engine, name), f"engine.__all__ names {name!r}, which engine does not define"


def test_g_the_server_is_found() -> None:
    assert any(p.name == "app.py" for p in SERVER_FILES)


@pytest.mark.parametrize("path", SERVER_FILES, ids=rel)
def test_g_the_server_imports_no_framework(path: Path) -> None:
    names = imports_of(path)
    bad = {n for n in names if n.split(".")[0].startswith(("langchain", "llama_index"))
           or n.startswith(FRAMEWORK_FACES)}
    assert not bad, f"{rel(path)} imports {sorted(bad)}"


def _engine_imports(path: Path, prefixes: tuple[str, ...]) -> set[str]:
    return {n for n in imports_of(path) if n.startswith(prefixes)}


# (h) what each subpackage must not import: the arrows point from the facade down to device.
# The facade and the runtime under it: nothing below them may import either.
FACADE = ("engine.engine", "engine.registry", "engine.runtime")
FORBIDDEN = {
    "device": ("engine.models", "engine.distributed", "engine.embedding", *FACADE),
    "requests": ("engine.core", "engine.device", "engine.distributed", "engine.embedding",
                 "engine.models", *FACADE),
    "requests/inbound": ("engine.requests.constraints", "engine.requests.outbound",
                         "engine.requests.prepare"),
    "requests/constraints": ("engine.requests.outbound", "engine.requests.prepare"),
    "requests/outbound": ("engine.requests.constraints", "engine.requests.prepare"),
    # A family's dialect writes constraints and reads output; it never prepares requests.
    "requests/dialects": ("engine.requests.prepare",),
    "core": ("engine.device", "engine.distributed", "engine.embedding", "engine.models",
             *FACADE),
    "models": ("engine.core", "engine.requests", "engine.distributed", "engine.embedding",
               *FACADE),
    "embedding": ("engine.distributed", "engine.models", "engine.requests", *FACADE),
    "distributed": ("engine.embedding", *FACADE),
    "_platform": ("engine.core", "engine.requests", "engine.device", "engine.distributed",
                  "engine.embedding", "engine.models", *FACADE),
    "runtime": ("engine.engine", "engine.registry"),
}
# device/ in wings, pointing one way: loading builds the lanes; the lanes use speed-ups,
# vision, prefix reuse, rows and adapters; every wing reaches upstream only through the seam.
_D = "engine.device."
WINGS = {
    "upstream": (),
    "kernels": ("upstream",),
    "adapters": (),
    "rows": ("upstream",),  # quantized KV rows (upstream.quantized_kv) cut and copied
    "prefix": ("rows", "upstream"),
    "vision": ("rows", "adapters", "upstream"),
    "speedups": ("rows", "adapters", "prefix", "upstream"),
    "lane": ("rows", "adapters", "prefix", "vision", "speedups", "upstream"),
    "embedding": (),
    "loading": ("upstream", "kernels", "adapters", "rows", "prefix", "vision", "speedups",
                "lane"),
}
for _wing, _uses in WINGS.items():  # each wing may import only the wings it names
    FORBIDDEN[f"device/{_wing}"] = (*FORBIDDEN["device"], *(
        f"{_D}{other}" for other in WINGS if other != _wing and other not in _uses))
LAYERED = [(pkg, p) for pkg in FORBIDDEN for p in sorted((ENGINE / pkg).rglob("*.py"))]
SUBPACKAGES = sorted(p.parent.relative_to(ENGINE).as_posix()
                     for p in ENGINE.rglob("__init__.py") if p.parent != ENGINE)


def test_h_device_wings_hold_every_device_module_and_form_no_circle() -> None:
    """No device module lies outside a wing, and the wings' allowances are a one-way
    order (a topological order exists), so no arrow leads back up."""
    loose = [p.name for p in DEVICE.glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"device modules outside a wing: {loose}"
    assert {p.name for p in DEVICE.iterdir() if (p / "__init__.py").is_file()} == set(WINGS)
    placed: list[str] = []
    while len(placed) < len(WINGS):
        ready = [w for w, uses in WINGS.items() if w not in placed and set(uses) <= set(placed)]
        assert ready, f"the wings' imports form a circle among {set(WINGS) - set(placed)}"
        placed += ready


def test_h_every_subpackage_is_found() -> None:
    for pkg in FORBIDDEN:
        assert (ENGINE / pkg / "__init__.py").is_file(), f"engine/{pkg}/ is gone"
    assert len(LAYERED) > 20


def test_h_every_subpackage_has_a_row() -> None:
    """A new subpackage gets its own row of rules (a package under a row's is covered by it
    and may add a row of its own)."""
    missing = [pkg for pkg in SUBPACKAGES
               if not any(pkg == row or pkg.startswith(f"{row}/") for row in FORBIDDEN)]
    assert not missing, f"engine subpackages without a layering row: {missing}"


@pytest.mark.parametrize(("package", "path"), LAYERED, ids=lambda v: v if isinstance(
    v, str) else rel(v))
def test_h_subpackages_point_one_way(package: str, path: Path) -> None:
    bad = _engine_imports(path, tuple(f"{f}." for f in FORBIDDEN[package])) | (
        {n for n in imports_of(path) if n in FORBIDDEN[package]})
    assert not bad, f"{rel(path)} (engine/{package}) imports {sorted(bad)}"


FIRST_PARTY = ("engine", "mlx_providers", "testkit", "tests", "bench")
SOURCE_FILES = [p for root in ("engine", "mlx_providers", "bench", "examples", "testkit")
                for p in sorted((ROOT / root).rglob("*.py"))]


@pytest.mark.parametrize("path", SOURCE_FILES, ids=rel)
def test_i_no_module_imports_another_modules_private_names(path: Path) -> None:
    own = module_name(path)
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and node.module.split(".")[0] in FIRST_PARTY and node.module != own):
            bad += [f"{node.module}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, f"{rel(path)} imports private names {bad}"


@pytest.mark.parametrize("path", [p for p in SOURCE_FILES
                                  if rel(p).startswith(("bench/", "examples/"))], ids=rel)
def test_i_bench_and_examples_import_nothing_from_tests(path: Path) -> None:
    bad = {n for n in imports_of(path) if n == "tests" or n.startswith("tests.")}
    assert not bad, f"{rel(path)} imports {sorted(bad)}: shared scaffolding lives in testkit/"


UNIT_FILES = sorted((ROOT / "tests" / "unit").rglob("*.py"))


@cache
def module_level_imports(path: Path) -> frozenset[str]:
    """What importing the file imports: its top-level statements (``if``/``try`` blocks
    included), not function bodies, which run only when called."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    todo: list[ast.stmt] = list(ast.parse(path.read_text(), str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] \
                if node.level else []
            module = ".".join([*base, node.module] if node.module else base) \
                if node.level else node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names
                         if source_of(f"{module}.{alias.name}") is not None)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += node.orelse  # the body runs only under a type checker
        elif isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return frozenset(names)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def mlx_reached_from(path: Path) -> list[str] | None:
    """The import chain from ``path`` to mlx or mlx_lm, if there is one."""
    todo = [(path, [rel(path)])]
    seen: set[Path] = {path}
    while todo:
        current, chain = todo.pop()
        for name in sorted(module_level_imports(current)):
            if name.split(".")[0] in MLX:
                return [*chain, name]
            parts = name.split(".")
            # A package is imported with its module: ``a.b.c`` runs a/__init__ and a/b/__init__.
            for depth in range(1, len(parts) + 1):
                source = source_of(".".join(parts[:depth]))
                if source is not None and source not in seen:
                    seen.add(source)
                    todo.append((source, [*chain, ".".join(parts[:depth])]))
    return None


def test_j_the_unit_files_are_found() -> None:
    assert len(UNIT_FILES) > 20 and any(p.name == "test_layering.py" for p in UNIT_FILES)


def test_j_the_rule_sees_mlx_through_a_chain() -> None:
    """The walk can fail: the engine's batch lane reaches mlx."""
    assert mlx_reached_from(DEVICE / "lane" / "batch_lane.py") is not None


@pytest.mark.parametrize("path", UNIT_FILES, ids=rel)
def test_j_the_unit_tier_imports_no_mlx(path: Path) -> None:
    chain = mlx_reached_from(path)
    assert chain is None, f"{' -> '.join(chain or [])}: move the test to tests/engine"
