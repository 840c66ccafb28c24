"""Generated garbage thrown at both adapters' calls while a long greedy row decodes on
their shared engine: every call succeeds or raises TypeError/ValueError with a message,
and the long row's tokens equal its run alone. Bounded by ``MLX_PROVIDERS_FUZZ_EXAMPLES``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_providers import ChatMLXBatch, MLXBatchLLM
from tests.conftest import own_copy
from tests.engine.test_fuzz_engine import FUZZ, LongRows, garbage, messages, scalars, tools

CLEAR = (TypeError, ValueError)
call_options = st.fixed_dictionaries(
    {}, optional={"temperature": scalars, "top_p": scalars, "seed": scalars,
                  "stop": garbage, "max_tokens": st.integers(1, 3) | garbage,
                  "tools": tools, "tool_choice": garbage | st.sampled_from(["auto", "f"])})
lc_inputs = (st.text(max_size=12) | st.lists(messages, max_size=3) | garbage
             | st.lists(st.tuples(st.sampled_from(["user", "ai", "system", "x"]),
                                  st.text(max_size=8) | garbage), max_size=3))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = own_copy(tiny_model_dir, tmp_path_factory.mktemp("fuzz-adapters") / "tiny")
    yield path
    ChatMLXBatch(model=str(path)).engine.close()


@pytest.fixture
def long_rows(model_dir: Path) -> Iterator[LongRows]:
    rows = LongRows(ChatMLXBatch(model=str(model_dir)).engine)
    yield rows
    rows.check()


def _clear(call: Any) -> str:
    try:
        call()
    except CLEAR as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return "refused"
    return "ok"


def test_garbage_to_chat_mlx_batch_fails_clearly(model_dir: Path, long_rows: LongRows) -> None:
    chat = ChatMLXBatch(model=str(model_dir), max_tokens=3)
    seen: set[str] = set()

    @FUZZ
    @given(value=lc_inputs, options=call_options)
    def check(value: Any, options: dict[str, Any]) -> None:
        long_rows.keep_running()
        seen.add(_clear(lambda: chat.invoke(value, **options)))

    check()
    assert seen == {"ok", "refused"}, seen


def test_garbage_to_mlx_batch_llm_fails_clearly(model_dir: Path, long_rows: LongRows) -> None:
    llm = MLXBatchLLM(str(model_dir), max_tokens=3)
    seen: set[str] = set()

    @FUZZ
    @given(value=st.text(max_size=12) | garbage | st.lists(garbage, max_size=3),
           chat=st.booleans())
    def check(value: Any, chat: bool) -> None:
        long_rows.keep_running()
        seen.add(_clear(lambda: llm.chat(value) if chat else llm.complete(value)))

    check()
    assert "refused" in seen and "ok" in seen, seen
