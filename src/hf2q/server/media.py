"""Where a request's images come from, and what the server lets them be.

An `image_url` is a data URL (base64) by default. Local files are read only under `--allowed-local-media-path`
(after resolving symlinks, so a link cannot lead outside it), and remote http(s) URLs are fetched only with
`--allow-remote-images`: a server reachable by clients must not read its own disk or reach the network on
their behalf unless told to. Every refusal is a 400 that names the content part; decoding runs off the
event loop, so a large image never stalls other requests.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import httpx

from hf2q.server.errors import bad_request

if TYPE_CHECKING:  # the image decoders (and torch) are imported when a request brings images
    from hf2q.vision.inputs import ImageInput
    from hf2q.vision.preprocess import ImageProcessing

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000  # decoded size; the tower sees at most ImageProcessing.max_pixels
DEFAULT_MAX_IMAGES = 8


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: Optional[Path] = None  # resolved; None: no local files
    allow_remote_images: bool = False
    image_fetch_timeout: float = 10.0  # seconds for a whole remote fetch
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images_per_request: int = DEFAULT_MAX_IMAGES


def add_media_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="image_url may name local files (file:// URLs) under DIR (default: none, no local files)")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="image_url may be an http(s) URL the server fetches (off by default)")
    p.add_argument("--image-fetch-timeout", type=float, default=10.0,
                   help="seconds a remote image fetch may take (default: %(default)s)")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                   help="largest encoded image accepted (default: %(default)s)")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="largest decoded image, width x height, accepted (default: %(default)s)")
    p.add_argument("--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES,
                   help="images one request may carry (default: %(default)s)")


def media_policy(args) -> MediaPolicy:
    """The policy from `hf2q serve` flags; a --allowed-local-media-path that is not a directory fails now."""
    root = getattr(args, "allowed_local_media_path", None)
    if root is not None:
        root = Path(root).resolve()
        if not root.is_dir():
            raise ValueError(f"--allowed-local-media-path {root}: not a directory")
    return MediaPolicy(allowed_local_media_path=root,
                       allow_remote_images=getattr(args, "allow_remote_images", False),
                       image_fetch_timeout=getattr(args, "image_fetch_timeout", 10.0),
                       max_image_bytes=getattr(args, "max_image_bytes", DEFAULT_MAX_IMAGE_BYTES),
                       max_image_pixels=getattr(args, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
                       max_images_per_request=getattr(args, "max_images_per_request", DEFAULT_MAX_IMAGES))


def _too_large(policy: MediaPolicy, param: str):
    return bad_request(f"image is larger than {policy.max_image_bytes} bytes (the server's --max-image-bytes)",
                       param=param)


def _data_url_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise bad_request("image data URLs must be base64: data:image/...;base64,...", param=param)
    if len(payload) * 3 // 4 > policy.max_image_bytes:
        raise _too_large(policy, param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("image data URL is not valid base64", param=param) from None


def _local_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise bad_request("local image files are not allowed: start the server with --allowed-local-media-path",
                          param=param)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise bad_request("file:// image URLs must name a local path", param=param)
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise bad_request("image file is outside the server's --allowed-local-media-path", param=param)
    if not path.is_file():
        raise bad_request("image file does not exist", param=param)
    if path.stat().st_size > policy.max_image_bytes:
        raise _too_large(policy, param)
    return path.read_bytes()


async def _remote_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    if not policy.allow_remote_images:
        raise bad_request("remote image URLs are not allowed: send a data URL, or start the server with "
                          "--allow-remote-images", param=param)
    try:
        async with asyncio.timeout(policy.image_fetch_timeout):
            async with httpx.AsyncClient(follow_redirects=True, timeout=policy.image_fetch_timeout) as client:
                async with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise bad_request(f"fetching the image failed: HTTP {response.status_code}", param=param)
                    declared = response.headers.get("content-length")
                    if declared and declared.isdigit() and int(declared) > policy.max_image_bytes:
                        raise _too_large(policy, param)
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > policy.max_image_bytes:
                            raise _too_large(policy, param)
                        chunks.append(chunk)
                    return b"".join(chunks)
    except TimeoutError:
        raise bad_request(f"fetching the image took longer than {policy.image_fetch_timeout} s "
                          f"(the server's --image-fetch-timeout)", param=param) from None
    except httpx.HTTPError:
        raise bad_request("fetching the image failed: the URL could not be reached", param=param) from None


async def image_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The encoded bytes an `image_url` names, under the server's policy."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(url, policy, param)
    if scheme == "file":
        return await asyncio.to_thread(_local_bytes, url, policy, param)
    if scheme in ("http", "https"):
        return await _remote_bytes(url, policy, param)
    raise bad_request("image_url must be a data:, file: or http(s): URL", param=param)


async def load_images(urls: list[tuple[str, str]], policy: MediaPolicy,
                      processing: ImageProcessing) -> list[ImageInput]:
    """(url, param) pairs in prompt order → preprocessed images; any problem is a 400 naming its part."""
    from hf2q.vision.preprocess import ImageError, load_image

    if len(urls) > policy.max_images_per_request:
        raise bad_request(f"the request carries {len(urls)} images, more than the limit of "
                          f"{policy.max_images_per_request} (the server's --max-images-per-request)",
                          param=urls[policy.max_images_per_request][1])
    images = []
    for url, param in urls:
        data = await image_bytes(url, policy, param)
        if len(data) > policy.max_image_bytes:
            raise _too_large(policy, param)
        try:
            images.append(await asyncio.to_thread(load_image, data, processing, policy.max_image_pixels))
        except ImageError as exc:
            raise bad_request(str(exc), param=param) from None
    return images
