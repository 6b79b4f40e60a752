"""Image sources under the server's policy: data URLs always, local files and remote URLs only when allowed."""
import asyncio
import base64
import http.server
import io
import threading
import time

import numpy as np
import PIL.Image
import pytest

from hf2q.server.errors import APIError
from hf2q.server.media import MediaPolicy, load_images
from hf2q.vision.preprocess import ImageProcessing

SMALL = ImageProcessing(min_pixels=32 * 32, max_pixels=64 * 64)


def png(width=48, height=40, seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def load(urls, policy=MediaPolicy()):
    return asyncio.run(load_images([(u, f"messages[0].content[{i}]") for i, u in enumerate(urls)], policy, SMALL))


def refused(urls, policy=MediaPolicy()) -> APIError:
    with pytest.raises(APIError) as info:
        load(urls, policy)
    assert info.value.status == 400
    return info.value


def test_data_urls_decode_in_order():
    a, b = png(seed=1), png(seed=2)
    images = load([data_url(a), data_url(b)])
    assert [i.content_hash for i in images] == [load([data_url(x)])[0].content_hash for x in (a, b)]
    assert images[0].content_hash != images[1].content_hash


@pytest.mark.parametrize("url,policy,message", [
    (data_url(b"garbage bytes"), MediaPolicy(), "not a supported image format"),
    (data_url(png()[:100]), MediaPolicy(), "corrupt or truncated"),
    ("data:image/png;base64,@@@", MediaPolicy(), "not valid base64"),
    ("data:image/png,rawbytes", MediaPolicy(), "must be base64"),
    (data_url(png()), MediaPolicy(max_image_bytes=50), "--max-image-bytes"),
    (data_url(png()), MediaPolicy(max_image_pixels=100), "more than the limit of 100"),
    ("ftp://example.com/x.png", MediaPolicy(), "must be a data:, file: or http(s): URL"),
    ("https://example.com/x.png", MediaPolicy(), "--allow-remote-images"),
    ("file:///etc/hostname", MediaPolicy(), "--allowed-local-media-path"),
], ids=["garbage", "truncated", "bad-base64", "not-base64", "too-many-bytes", "too-many-pixels", "ftp",
        "remote-off", "local-off"])
def test_bad_sources_are_a_400_naming_the_part(url, policy, message):
    error = refused([url], policy)
    assert message in error.message and error.param == "messages[0].content[0]"


def test_too_many_images_names_the_first_extra_one():
    error = refused([data_url(png())] * 3, MediaPolicy(max_images_per_request=2))
    assert "more than the limit of 2" in error.message and error.param == "messages[0].content[2]"


def test_local_files_only_under_the_allowed_directory(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir(), outside.mkdir()
    (allowed / "a.png").write_bytes(png(seed=5))
    (outside / "b.png").write_bytes(png(seed=6))
    (allowed / "link.png").symlink_to(outside / "b.png")
    policy = MediaPolicy(allowed_local_media_path=allowed.resolve())
    assert load([f"file://{allowed}/a.png"], policy)[0].content_hash == load([data_url(png(seed=5))])[0].content_hash
    for escape in (f"file://{allowed}/link.png", f"file://{allowed}/../private/b.png"):
        assert "outside" in refused([escape], policy).message
    assert "does not exist" in refused([f"file://{allowed}/missing.png"], policy).message


@pytest.fixture(scope="module")
def image_site():
    """A real HTTP server: /ok.png an image, /slow.png after 2 s, /missing.png a 404."""
    body = png(seed=7)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow.png":
                time.sleep(2)
            if self.path not in ("/ok.png", "/slow.png"):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout case)
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", body
    server.shutdown()


def test_remote_images_when_allowed(image_site):
    site, body = image_site
    remote = MediaPolicy(allow_remote_images=True, image_fetch_timeout=0.5)
    assert load([f"{site}/ok.png"], remote)[0].content_hash == load([data_url(body)])[0].content_hash
    assert "HTTP 404" in refused([f"{site}/missing.png"], remote).message
    assert "--image-fetch-timeout" in refused([f"{site}/slow.png"], remote).message
    small = MediaPolicy(allow_remote_images=True, max_image_bytes=len(body) - 1)
    assert "--max-image-bytes" in refused([f"{site}/ok.png"], small).message
