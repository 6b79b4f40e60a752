"""Image bytes → `ImageInput`, with the semantics of HF's Qwen2-VL image processor (which Qwen3.5 uses).

The vision tower was trained on images prepared exactly this way, so every step follows the HF processor:
transparency composited onto white, a bicubic resize to the nearest multiple of `patch_size * merge_size`
within the pixel budget, rescale to [0, 1] in float64 then float32, normalise with the checkpoint's mean and
std, and the patch layout that groups each 2x2 merge window together. A still image fills both temporal slots.
"""
from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import PIL.Image
import torch

from hf2q.vision.inputs import ImageInput


class ImageError(ValueError):
    """An image the server cannot use; the message is safe to show the client."""


@dataclass(frozen=True)
class ImageProcessing:
    """The preprocessing constants of a Qwen3.5 vision tower (HF's `preprocessor_config.json`)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # HF's size["shortest_edge"]
    max_pixels: int = 16777216  # HF's size["longest_edge"]
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        """Both sides of the resized image are multiples of this: one merge window of patches."""
        return self.patch_size * self.merge_size


def image_processing(tower_config) -> ImageProcessing:
    """The preprocessing a loaded tower expects (`checkpoint.mmproj.VisionConfig`); the pixel budget is HF's."""
    return ImageProcessing(patch_size=tower_config.patch_size, temporal_patch_size=tower_config.temporal_patch_size,
                           merge_size=tower_config.merge_size, image_mean=tuple(tower_config.image_mean),
                           image_std=tuple(tower_config.image_std))


def smart_resize(height: int, width: int, processing: ImageProcessing) -> tuple[int, int]:
    """The (height, width) HF resizes to: multiples of `factor`, aspect kept, pixels within the budget."""
    factor = processing.factor
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio {width}x{height} is more extreme than 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > processing.max_pixels:
        beta = math.sqrt(height * width / processing.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < processing.min_pixels:
        beta = math.sqrt(processing.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, max_pixels: int) -> PIL.Image.Image:
    """Decode image bytes, refusing unreadable data and images over `max_pixels` before decompressing them."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            image = PIL.Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(f"image is {width}x{height} pixels, more than the limit of {max_pixels}")
            image.load()
    except ImageError:
        raise
    except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning):
        raise ImageError("image is too large to decode") from None
    except PIL.UnidentifiedImageError:
        raise ImageError("image data is not a supported image format") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError("image data is corrupt or truncated") from exc
    if min(image.size) < 1:
        raise ImageError("image has no pixels")
    return image


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB, with any transparency (alpha band or palette transparency) composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def patchify(image: np.ndarray, processing: ImageProcessing) -> tuple[np.ndarray, int, int]:
    """[C, H, W] → [grid_h * grid_w, C * T * P * P], the 2x2 merge windows contiguous, the frame repeated T times."""
    p, m, t = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    channels, height, width = image.shape
    grid_h, grid_w = height // p, width // p
    # [C, gh/m, m, P, gw/m, m, P] → [gh/m, gw/m, m, m, C, P, P]
    patches = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    # a still image fills every temporal slot: [gh/m, gw/m, m, m, C, T, P, P]
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return patches.reshape(grid_h * grid_w, channels * t * p * p), grid_h, grid_w


def preprocess_image(image: PIL.Image.Image, processing: ImageProcessing) -> ImageInput:
    """A decoded image → the tower's `pixel_values`, its patch grid and a hash of both."""
    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, processing)
    resized = np.asarray(rgb.resize((width, height), resample=PIL.Image.Resampling.BICUBIC))  # [H, W, 3] uint8
    scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(processing.image_mean, dtype=np.float32)
    std = np.asarray(processing.image_std, dtype=np.float32)
    normalised = ((scaled - mean) / std).transpose(2, 0, 1)  # [3, H, W]
    pixels, grid_h, grid_w = patchify(normalised, processing)
    pixels = np.ascontiguousarray(pixels, dtype=np.float32)
    grid_thw = (1, grid_h, grid_w)
    digest = hashlib.sha256(repr(grid_thw).encode())
    digest.update(pixels.tobytes())
    return ImageInput(pixel_values=torch.from_numpy(pixels), grid_thw=grid_thw, content_hash=digest.hexdigest(),
                      merge_size=processing.merge_size)


def load_image(data: bytes, processing: ImageProcessing, max_pixels: int) -> ImageInput:
    """Decode and preprocess image bytes (CPU work: call it off the event loop)."""
    return preprocess_image(decode_image(data, max_pixels), processing)
