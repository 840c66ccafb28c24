"""Image parts at the rulebook: every ecosystem's shape read, every bad image refused by part."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest

from engine import InvalidRequestError, messages_from_openai
from engine.requests.inbound.images import IMAGE_MARK

PIL = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow (the vision extra)")


def encoded(fmt: str = "PNG", size: tuple[int, int] = (8, 6),
            colour: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    PIL.new("RGB", size, colour).save(buffer, format=fmt)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def user(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(encoded())}"}},
    {"type": "image_url", "image_url": f"data:image/png;base64,{b64(encoded())}"},
    {"type": "input_image", "image_url": f"data:image/png;base64,{b64(encoded())}"},
    {"type": "image", "base64": b64(encoded()), "mime_type": "image/png"},
    {"type": "image", "source_type": "base64", "data": b64(encoded()), "mime_type": "image/png"},
    {"type": "image", "url": f"data:image/png;base64,{b64(encoded())}"},
])
def test_each_shape_reads_the_same_image(part: dict[str, Any]) -> None:
    message = messages_from_openai(user({"type": "text", "text": "look "}, part))[0]
    assert message.content == "look " + IMAGE_MARK
    (image,) = message.images
    assert image.size == (8, 6)
    reference = messages_from_openai(user(
        {"type": "image_url", "image_url": {"url": f"data:image/bmp;base64,"
                                                   f"{b64(encoded('BMP'))}"}}))[0].images[0]
    assert image.digest == reference.digest  # same pixels, another encoding: same image


def test_images_keep_their_order_across_messages() -> None:
    red = f"data:image/png;base64,{b64(encoded(colour=(255, 0, 0)))}"
    blue = f"data:image/png;base64,{b64(encoded(colour=(0, 0, 255)))}"
    messages = messages_from_openai([
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": red}},
                                     {"type": "image_url", "image_url": {"url": blue}}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "shot", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c",
         "content": [{"type": "image_url", "image_url": {"url": red}}]},
    ])
    assert messages[0].content == IMAGE_MARK * 2 and messages[2].content == IMAGE_MARK
    digests = [i.digest for m in messages for i in m.images]
    assert digests[0] == digests[2] != digests[1]


def _huge_png() -> bytes:
    buffer = io.BytesIO()
    PIL.new("L", (8000, 6000)).save(buffer, format="PNG")  # 48 MP, a few KB compressed
    return buffer.getvalue()


@pytest.mark.parametrize(("part", "match"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "remote image URLs are not fetched"),
    ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "local paths are not read"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "local paths"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
     "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain,hello"}}, "must be base64"),
    ({"type": "image", "base64": b64(b"not an image at all"), "mime_type": "image/png"},
     "not a readable image"),
    ({"type": "image", "base64": b64(encoded()[:40]), "mime_type": "image/png"},
     "not a readable image"),
    ({"type": "image", "base64": b64(encoded("PPM")), "mime_type": "image/x-portable-pixmap"},
     "PPM images are not read"),
    ({"type": "image", "base64": b64(_huge_png()), "mime_type": "image/png"},
     "over the limit"),
    ({"type": "image", "file_id": "file-1"}, "by file id"),
    ({"type": "image_url", "image_url": {}}, "needs the image"),
])
def test_bad_images_are_refused_naming_the_part(part: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as raised:
        messages_from_openai(user({"type": "text", "text": "see"}, part))
    assert raised.value.field.startswith("messages[0].content[1]")


def test_the_image_mark_is_refused_as_text() -> None:
    with pytest.raises(InvalidRequestError, match="U\\+FFFC"):
        messages_from_openai([{"role": "user", "content": f"a {IMAGE_MARK} b"}])


def test_other_media_are_still_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError, match="'file' parts are refused"):
        messages_from_openai(user({"type": "file", "file": {"file_id": "f1"}}))


def test_bytes_seen_again_are_not_decoded_until_their_pixels_are_read() -> None:
    from engine.requests.inbound.images import decoded_image

    data = encoded(size=(9, 7), colour=(1, 2, 3))
    first = decoded_image(data, "a")
    again = decoded_image(data, "b")
    assert again._pixels is None  # a hash of the bytes, no decode
    assert (again.digest, again.size, again.at) == (first.digest, first.size, "b")
    assert (again.pixels == first.pixels).all()  # decoded on demand, the same pixels


def test_large_base64_is_decoded_in_pieces_as_strictly_as_whole() -> None:
    from engine.requests.inbound import images

    data = bytes(range(256)) * 20_000  # 5 MB: several pieces
    text = b64(data)
    assert len(text) > 3 * images._B64_PIECE
    assert images._b64decoded(text) == data
    inside = text[:images._B64_PIECE - 4] + "AA==" + text[images._B64_PIECE:]
    with pytest.raises(ValueError, match="padding"):  # binascii.Error is a ValueError
        images._b64decoded(inside)
    with pytest.raises(ValueError):
        images._b64decoded(text[:-1])  # a cut final quantum
