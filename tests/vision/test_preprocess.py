"""hf2q's image preprocessing equals HF's Qwen2-VL image processor (PIL backend), pixel for pixel."""
import io

import numpy as np
import PIL.Image
import pytest

from hf2q.vision.preprocess import ImageError, ImageProcessing, decode_image, load_image

processor_module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

QWEN35 = ImageProcessing()


def hf_processor(processing: ImageProcessing):
    return processor_module.Qwen2VLImageProcessorPil(
        patch_size=processing.patch_size, temporal_patch_size=processing.temporal_patch_size,
        merge_size=processing.merge_size, image_mean=list(processing.image_mean),
        image_std=list(processing.image_std),
        size={"shortest_edge": processing.min_pixels, "longest_edge": processing.max_pixels})


def encoded(image: PIL.Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def noise_image(mode: str, width: int, height: int, seed: int) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "P":
        image = PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).quantize(16)
        image.info["transparency"] = 3  # palette transparency: composited onto white like an alpha band
        return image
    bands = len(PIL.Image.new(mode, (1, 1)).getbands())
    shape = (height, width, bands) if bands > 1 else (height, width)
    return PIL.Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


CASES = [  # (mode, width, height, processing)
    ("RGB", 640, 480, QWEN35),  # min-pixel upscale
    ("RGB", 700, 300, ImageProcessing(min_pixels=32 * 32, max_pixels=256 * 256)),  # round to factor
    ("RGBA", 333, 517, ImageProcessing(min_pixels=32 * 32, max_pixels=128 * 128)),  # max-pixel downscale
    ("L", 97, 41, ImageProcessing(min_pixels=32 * 32, max_pixels=256 * 256)),
    ("P", 200, 120, ImageProcessing(min_pixels=32 * 32, max_pixels=256 * 256)),
    ("RGB", 150, 90, ImageProcessing(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 64,
                                     image_mean=(0.48145466, 0.4578275, 0.40821073),
                                     image_std=(0.26862954, 0.26130258, 0.27577711))),  # Qwen2-VL constants
]


@pytest.mark.parametrize("mode,width,height,processing", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_matches_hf_processor(mode, width, height, processing):
    image = noise_image(mode, width, height, seed=width)
    data = encoded(image)
    ours = load_image(data, processing, max_pixels=10**8)
    theirs = hf_processor(processing)(PIL.Image.open(io.BytesIO(data)), return_tensors="np")
    assert tuple(theirs["image_grid_thw"][0]) == ours.grid_thw
    np.testing.assert_array_equal(ours.pixel_values.numpy(), theirs["pixel_values"])
    assert ours.num_tokens == ours.grid_thw[1] * ours.grid_thw[2] // 4


def test_content_hash_follows_the_pixels():
    small = ImageProcessing(min_pixels=32 * 32, max_pixels=64 * 64)
    a = encoded(noise_image("RGB", 64, 64, seed=1))
    b = encoded(noise_image("RGB", 64, 64, seed=2))
    jpeg_of_a = encoded(PIL.Image.open(io.BytesIO(a)), "JPEG")
    hash_a = load_image(a, small, 10**6).content_hash
    assert hash_a == load_image(a, small, 10**6).content_hash
    assert hash_a != load_image(b, small, 10**6).content_hash
    assert hash_a != load_image(jpeg_of_a, small, 10**6).content_hash  # lossy re-encode changes the pixels


@pytest.mark.parametrize("data,message", [
    (b"not an image at all", "not a supported image format"),
    (encoded(noise_image("RGB", 64, 64, seed=3))[:200], "corrupt or truncated"),
    (encoded(noise_image("RGB", 300, 200, seed=4)), "more than the limit of 10000"),
])
def test_bad_images_are_refused_by_name(data, message):
    with pytest.raises(ImageError, match=message):
        decode_image(data, max_pixels=10_000)


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(ImageError, match="aspect ratio"):
        load_image(encoded(noise_image("L", 1000, 4, seed=5)), QWEN35, 10**6)


def test_a_loaded_projector_preprocesses_as_its_checkpoints_processor():
    """The constants come from the mmproj file; the result equals HF's processor of the source checkpoint."""
    from hf2q.checkpoint.mmproj import load_mmproj
    from hf2q.vision.preprocess import image_processing
    from tests.support.fixtures import hf_vl_checkpoint, our_vl_ggufs

    processing = image_processing(load_mmproj(our_vl_ggufs("dense")[1]).config)
    hf = processor_module.Qwen2VLImageProcessorPil.from_pretrained(hf_vl_checkpoint("dense"))
    data = encoded(noise_image("RGBA", 300, 170, seed=9))
    ours = load_image(data, processing, max_pixels=10**8)
    theirs = hf(PIL.Image.open(io.BytesIO(data)), return_tensors="np")
    assert tuple(theirs["image_grid_thw"][0]) == ours.grid_thw
    np.testing.assert_array_equal(ours.pixel_values.numpy(), theirs["pixel_values"])
