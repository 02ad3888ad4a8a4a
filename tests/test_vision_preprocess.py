"""posttrain.vision.preprocess against transformers 5.12's image processors (issue #52).

The references are transformers' PIL backends, `Gemma3ImageProcessorPil` and `Qwen2VLImageProcessorPil` (the
class transformers' AutoImageProcessor maps `qwen3_vl` to): the torchvision classes the checkpoints name need
torchvision, which the test venv does not have. Each is built from the values of the real checkpoints'
preprocessor_config.json written below (google/gemma-3-4b-it; Qwen/Qwen3-VL-8B-Instruct; Qwen2-VL's class
defaults for the 14-pixel patches, CLIP statistics and the max_pixels shrink), nothing downloaded. Gemma 3's is
called with Gemma3Processor's images_kwargs (do_convert_rgb, pan-and-scan off), as the processor calls it.
Twenty generated images (fixed seed): tiny, very wide, very tall, sizes that are no multiple of a patch, in RGB,
RGBA and L; pixel values within 1e-6, grids, crop counts and image-token counts equal.
"""

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from posttrain.errors import PosttrainError
from posttrain.vision import (
    gemma3_num_crops,
    gemma3_pixels,
    load_image,
    processor_settings,
    qwen_vl_grid,
    qwen_vl_image_tokens,
    qwen_vl_patches,
    smart_resize,
)

pytestmark = pytest.mark.parity

GEMMA3_CONFIG = {  # google/gemma-3-4b-it preprocessor_config.json
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
    "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896},
}
# Gemma3Processor's images_kwargs defaults: what its __call__ hands the image processor.
GEMMA3_CALL = {"do_convert_rgb": True, "do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256,
               "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
QWEN3_VL_CONFIG = {  # Qwen/Qwen3-VL-8B-Instruct preprocessor_config.json
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN2_VL_CONFIG = {  # Qwen2-VL's values (Qwen2VLImageProcessor's class defaults)
    "min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3, "image_processor_type": "Qwen2VLImageProcessor",
}
TOL = 1e-6

# (width, height): tiny, square, very wide / tall (Qwen's limit is 200:1), odd sizes, above Qwen2-VL's max_pixels,
# 400 x 336 at halves of Qwen3-VL's 32 (12.5, 10.5: Python's round goes to even).
SIZES = [(1, 1), (2, 3), (7, 5), (16, 16), (31, 33), (896, 896), (1000, 6), (7, 1300), (333, 517), (640, 480),
         (1201, 97), (45, 1024), (257, 255), (1280, 720), (1500, 800), (400, 336), (3, 400), (512, 1536),
         (1023, 1025), (100, 3)]
MODES = ["RGB", "RGBA", "L"]


def make_images(seed: int = 0) -> list[Image.Image]:
    """Twenty images: noise over a gradient (resampling sees both edges and smooth parts), modes in turn."""
    rng = np.random.default_rng(seed)
    images = []
    for i, (w, h) in enumerate(SIZES):
        mode = MODES[i % 3]
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        ramp = np.linspace(0, 200, w)[None, :, None] + np.linspace(0, 55, h)[:, None, None]
        pixels = np.clip(ramp + rng.normal(0, 40, (h, w, channels)), 0, 255).astype(np.uint8)
        images.append(Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode))
    return images


@pytest.fixture(scope="module")
def images():
    return make_images()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> a folder holding that checkpoint's preprocessor_config.json."""
    root = tmp_path_factory.mktemp("processors")
    return {name: write_folder(root / name, config) for name, config in
            [("gemma3", GEMMA3_CONFIG), ("qwen3_vl", QWEN3_VL_CONFIG), ("qwen2_vl", QWEN2_VL_CONFIG)]}


@pytest.fixture(scope="module")
def gemma3_reference():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(**GEMMA3_CONFIG)


def qwen_reference(config):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if "class" not in k and "type" not in k})


def write_folder(path, preprocessor=None, processor=None):
    path.mkdir(parents=True, exist_ok=True)
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    if processor is not None:
        (path / "processor_config.json").write_text(json.dumps(processor))
    return path


def test_the_images_cover_sizes_and_modes(images):
    assert len(images) == 20 and {im.mode for im in images} == set(MODES)
    assert min(im.width * im.height for im in images) == 1
    assert max(im.width / im.height for im in images) > 150 and max(im.height / im.width for im in images) > 150


def test_gemma3_pixels_equal_transformers(images, gemma3_reference, folders):
    ref = gemma3_reference(images, return_tensors="np", **GEMMA3_CALL)
    ours = gemma3_pixels(images, **processor_settings(folders["gemma3"]).options)
    assert ours.shape == ref["pixel_values"].shape == (20, 3, 896, 896) and ours.dtype == np.float32
    assert np.abs(ours - ref["pixel_values"]).max() <= TOL
    assert gemma3_num_crops([(im.height, im.width) for im in images]) == list(ref["num_crops"]) == [0] * 20


def test_gemma3_pan_and_scan_equals_transformers(images, gemma3_reference):
    """Pan-and-scan on (not the default): each long image followed by its crops, and the crop counts."""
    chosen = [images[i] for i in (5, 7, 9, 13, 14, 17, 18)]  # square, tall, 4:3, 16:9, wide, 1:3, near-square
    call = dict(GEMMA3_CALL, do_pan_and_scan=True)
    ref = gemma3_reference(chosen, return_tensors="np", **call)
    ours = gemma3_pixels(chosen, pan_and_scan=True)
    crops = gemma3_num_crops([(im.height, im.width) for im in chosen], pan_and_scan=True)
    assert crops == list(ref["num_crops"]) and sum(crops) > 0
    assert ours.shape == ref["pixel_values"].shape == (len(chosen) + sum(crops), 3, 896, 896)
    assert np.abs(ours - ref["pixel_values"]).max() <= TOL


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_vl"])
def test_qwen_vl_patches_equal_transformers(images, folders, name):
    config = {"qwen3_vl": QWEN3_VL_CONFIG, "qwen2_vl": QWEN2_VL_CONFIG}[name]
    reference = qwen_reference(config)
    ref = reference(images, return_tensors="np")
    settings = processor_settings(folders[name])
    pixels, grid = qwen_vl_patches(images, **settings.options)
    assert pixels.dtype == np.float32 and grid.dtype == np.int64
    assert np.array_equal(grid, ref["image_grid_thw"])
    assert pixels.shape == ref["pixel_values"].shape
    assert np.abs(pixels - ref["pixel_values"]).max() <= TOL
    merge = config["merge_size"]
    tokens = qwen_vl_image_tokens(grid, merge)
    # the processor's count: grid.prod() // merge_size**2, and its size-only count (vLLM's)
    assert tokens.tolist() == [int(g.prod()) // merge ** 2 for g in ref["image_grid_thw"]]
    assert tokens.tolist() == [reference.get_number_of_image_patches(im.height, im.width, {}) // merge ** 2
                               for im in images]
    assert [qwen_vl_grid(im.height, im.width, **settings.options) for im in images] == [tuple(g) for g in grid.tolist()]
    assert pixels.shape[0] == int(grid.prod(axis=1).sum())


def test_smart_resize_equals_transformers():
    """Every height and width in a sweep (halves of the factor, the min / max pixel branches, 200:1) as
    transformers' smart_resize, and both refuse over 200:1."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    sides = list(range(1, 130)) + [176, 208, 336, 400, 1000, 1023, 1024, 1025, 4095, 4096, 5000]
    for factor, lo, hi in [(32, 65536, 16777216), (28, 3136, 1003520)]:
        for h in sides:
            for w in sides:
                if max(h, w) / min(h, w) <= 200:
                    assert smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi) == reference(
                        h, w, factor=factor, min_pixels=lo, max_pixels=hi), (h, w, factor)
    with pytest.raises(ValueError):
        reference(1, 201)
    with pytest.raises(PosttrainError, match="aspect ratio over 200"):
        smart_resize(1, 201)


def test_qwen2_vl_shrinks_above_max_pixels(images, folders):
    grid = qwen_vl_patches(images[14:15], **processor_settings(folders["qwen2_vl"]).options)[1]
    assert int(grid[0, 1] * grid[0, 2]) * 14 * 14 <= QWEN2_VL_CONFIG["max_pixels"] < 1500 * 800


@pytest.mark.parametrize("mode", ["P", "LA", "1", "CMYK", "I;16"])
def test_other_modes_convert_as_transformers(mode):
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (37, 61, 3), dtype=np.uint8)).convert(mode)
    ref = qwen_reference(QWEN3_VL_CONFIG)([image], return_tensors="np")
    pixels, grid = qwen_vl_patches([image])
    assert np.array_equal(grid, ref["image_grid_thw"]) and np.abs(pixels - ref["pixel_values"]).max() <= TOL


def test_files_bytes_and_arrays_equal_the_pil_images(images, tmp_path, gemma3_reference):
    """Paths (EXIF orientation applied, as transformers' load_image), bytes, datasets.Image dicts and uint8
    arrays give the same pixels as transformers called with the paths."""
    picks = [images[i] for i in (3, 4, 8)]
    paths = []
    for i, im in enumerate(picks):
        paths.append(str(tmp_path / f"im{i}.png"))
        im.save(paths[-1])
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to view
    paths.append(str(tmp_path / "turned.jpg"))
    images[13].convert("RGB").save(paths[-1], exif=exif, quality=95)
    ref = qwen_reference(QWEN3_VL_CONFIG)(paths, return_tensors="np")
    pixels, grid = qwen_vl_patches(paths)
    assert np.array_equal(grid, ref["image_grid_thw"]) and np.abs(pixels - ref["pixel_values"]).max() <= TOL
    assert tuple(grid[-1]) == qwen_vl_grid(1280, 720)  # turned: 720 wide, 1280 tall
    as_bytes = [open(p, "rb").read() for p in paths[:3]]
    dicts = [{"bytes": None, "path": p} for p in paths[:3]]
    arrays = [np.asarray(im) for im in picks]
    expected = gemma3_reference(paths[:3], return_tensors="np", **GEMMA3_CALL)["pixel_values"]
    for sources in (as_bytes, dicts, arrays):
        assert np.abs(gemma3_pixels(sources) - expected).max() <= TOL


def test_bad_images_raise_posttrain_errors_naming_them(images, tmp_path):
    good = tmp_path / "good.png"
    images[8].save(good)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    missing = tmp_path / "nowhere" / "missing.png"
    with pytest.raises(PosttrainError, match=r"image 1 \(.*truncated\.png\): not a readable image"):
        qwen_vl_patches([str(good), str(truncated)])
    with pytest.raises(PosttrainError, match=r"image 0 \(.*missing\.png\): no such file"):
        gemma3_pixels([missing])
    with pytest.raises(PosttrainError, match=r"image 2: not a readable image"):
        gemma3_pixels([images[0], images[1], truncated.read_bytes()])
    with pytest.raises(PosttrainError, match=r"image 0 \(.*truncated\.png\)"):
        load_image({"bytes": None, "path": str(truncated)}, index=0)
    with pytest.raises(PosttrainError, match=r"image 1: .*aspect ratio over 200"):
        qwen_vl_patches([images[0], Image.new("RGB", (1000, 4))])
    with pytest.raises(PosttrainError, match="uint8"):
        gemma3_pixels([np.zeros((4, 4, 3), np.float32)])


def test_processor_settings_read_the_checkpoints(tmp_path):
    gemma = processor_settings(write_folder(tmp_path / "g", GEMMA3_CONFIG, {"image_seq_length": 256,
                                                                            "processor_class": "Gemma3Processor"}))
    assert gemma.kind == "gemma3" and gemma.image_seq_length == 256
    assert gemma.options["size"] == (896, 896) and gemma.options["resample"] == 2
    assert gemma.options["pan_and_scan"] is False and gemma.options["image_mean"] == (0.5, 0.5, 0.5)
    qwen = processor_settings(write_folder(tmp_path / "q", QWEN3_VL_CONFIG))
    assert qwen.kind == "qwen_vl" and qwen.image_seq_length is None
    assert {k: qwen.options[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
                                         "max_pixels", "resample")} == {
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 65536, "max_pixels": 16777216,
        "resample": 3}
    # transformers' newer layout: the image processor nested in processor_config.json wins over the other file
    nested = processor_settings(write_folder(tmp_path / "n", {"image_processor_type": "Nothing"},
                                             {"image_processor": dict(QWEN3_VL_CONFIG, patch_size=14)}))
    assert nested.options["patch_size"] == 14 and "processor_config.json" in nested.source


def test_processor_settings_errors_name_the_file_and_key(tmp_path):
    config = dict(QWEN3_VL_CONFIG)
    del config["merge_size"]
    with pytest.raises(PosttrainError, match=r"preprocessor_config\.json: the key 'merge_size' is missing"):
        processor_settings(write_folder(tmp_path / "a", config))
    with pytest.raises(PosttrainError, match=r"preprocessor_config\.json.*'longest_edge' is missing"):
        processor_settings(write_folder(tmp_path / "b", dict(QWEN3_VL_CONFIG, size={"shortest_edge": 1})))
    with pytest.raises(PosttrainError, match=r"preprocessor_config\.json: the key 'size' is missing"):
        processor_settings(write_folder(tmp_path / "c", {k: v for k, v in GEMMA3_CONFIG.items() if k != "size"}))
    with pytest.raises(PosttrainError, match=r"'SiglipImageProcessor' is not one posttrain implements"):
        siglip = dict(GEMMA3_CONFIG, image_processor_type="SiglipImageProcessor")
        processor_settings(write_folder(tmp_path / "d", siglip))
    with pytest.raises(PosttrainError, match="no preprocessor_config.json"):
        processor_settings(write_folder(tmp_path / "e"))
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(PosttrainError, match=r"preprocessor_config\.json: cannot be read as JSON"):
        processor_settings(tmp_path / "f")


def test_no_torch_or_transformers_at_run_time():
    code = ("import sys; from posttrain.vision import gemma3_pixels, qwen_vl_patches; from PIL import Image; "
            "im = Image.new('RGBA', (40, 30)); gemma3_pixels([im], size=32); qwen_vl_patches([im]); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision', 'transformers', "
            "'jax')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_in_memory_pil_image_truncated_file():
    """A PIL image opened lazily from a truncated file fails with a PosttrainError when decoded."""
    buffer = io.BytesIO()
    make_images()[9].save(buffer, format="PNG")
    lazy = Image.open(io.BytesIO(buffer.getvalue()[:2000]))
    with pytest.raises(PosttrainError, match="image 0: not a readable image"):
        gemma3_pixels([lazy])
