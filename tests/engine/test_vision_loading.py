"""A vision checkpoint's load: text is served without the vision stack, which the first image
imports; without the ``vision`` extra, images are refused by part, naming it.

Each case runs in a fresh interpreter (what is imported is process-wide), on the tiny
Gemma 3 VLM (``testkit.vision_model``).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine
from testkit.vision_model import solid_image
from tests.conftest import greedy
from tests.engine.test_vision import RED, asking, image_part, tokens, vlm_engine

pytestmark = pytest.mark.timeout(600)

# Ways a process lacks mlx-vlm, each set up before ``engine`` is imported.
WITHOUT_MLX_VLM = {
    # Python's own marker for "not importable": find_spec answers None.
    "absent": "sys.modules['mlx_vlm'] = None\n",
    # An import hook that refuses it: find_spec itself raises.
    "refused": (
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mlx_vlm':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Refuse())\n"),
    # Installed but broken (a dependency missing): found, yet its import fails.
    "broken": (
        "import importlib.abc, importlib.machinery\n"
        "class Broken(importlib.abc.Loader):\n"
        "    def create_module(self, spec):\n"
        "        return None\n"
        "    def exec_module(self, module):\n"
        "        raise ImportError(\"No module named 'cv2'\", name='cv2')\n"
        "class Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mlx_vlm':\n"
        "            return importlib.machinery.ModuleSpec(name, Broken())\n"
        "        return None\n"
        "sys.meta_path.insert(0, Finder())\n"),
}

# Serves a text request, then an image request, reporting what happened as JSON.
SCRIPT = """
import json
import engine
from engine import ChatRequest, Engine, EngineConfig, InvalidRequestError, SamplingParams

report = {}
eng = Engine(MODEL, EngineConfig()).start()
params = SamplingParams(max_tokens=3, temperature=0.0)
text = eng.submit(ChatRequest.from_openai([{"role": "user", "content": "hi"}], params))
report["text_tokens"] = len(text.result(120).token_ids)
report["vlm_after_text"] = "mlx_vlm" in sys.modules
report["images_after_text"] = eng.stats().vision_images
image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                      {"type": "text", "text": "What is it?"}]}]
try:
    answer = eng.submit(ChatRequest.from_openai(image, params)).result(120)
    report["image_tokens"] = len(answer.token_ids)
except InvalidRequestError as exc:
    report["refused"] = [str(exc), exc.field]
report["vlm_after_image"] = "mlx_vlm" in sys.modules
report["images_after_image"] = eng.stats().vision_images
again = eng.submit(ChatRequest.from_openai([{"role": "user", "content": "hi"}], params))
report["text_again"] = len(again.result(120).token_ids)
eng.close()
print(json.dumps(report))
"""


def served(model: Path, setup: str = "") -> dict[str, object]:
    """What the script reports in a fresh interpreter after ``setup``."""
    url = f"data:image/png;base64,{base64.b64encode(solid_image(RED, 40)).decode()}"
    script = (f"import sys\n{setup}MODEL = {str(model)!r}\nIMAGE = {url!r}\n{SCRIPT}")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("how", sorted(WITHOUT_MLX_VLM))
def test_without_the_vision_extra_text_is_served_and_images_refused_by_part(
        tiny_vlm_dir: Path, how: str) -> None:
    report = served(tiny_vlm_dir, WITHOUT_MLX_VLM[how])
    assert report["text_tokens"] == 3 and report["text_again"] == 3
    message, field = report["refused"]  # type: ignore[misc]
    assert field == "messages[0].content[0]"
    assert message.startswith("messages[0].content[0]: ")
    assert "pip install 'mlx-providers[vision]'" in message
    assert "image_tokens" not in report and report["images_after_image"] == 0


def test_the_vision_stack_is_imported_by_the_first_image_not_at_load(
        tiny_vlm_dir: Path) -> None:
    report = served(tiny_vlm_dir)
    assert report["text_tokens"] == 3
    assert report["vlm_after_text"] is False and report["images_after_text"] == 0
    assert report["image_tokens"] == 3 and "refused" not in report
    assert report["vlm_after_image"] is True and report["images_after_image"] == 1
    assert report["text_again"] == 3


def test_the_tower_counts_in_the_bounds_from_load_as_built(
        make_engine: Callable[..., Engine], family_vlm_dir: Path) -> None:
    eng = vlm_engine(make_engine, family_vlm_dir, vision_cache_bytes=1 << 20)
    composition = eng._runtime.composition
    assert composition is not None
    vision = composition.built.lanes.batch.vision
    bounds = composition.built.model.bounds
    assert vision is not None and vision.built is None  # no image yet: no tower
    tokens(eng, asking(image_part(RED)), greedy(2))
    assert vision.built is not None
    # Sized from the checkpoint's headers at load: exactly the built tower's weights.
    assert bounds.vision_bytes == vision.built.weight_bytes + (1 << 20)
