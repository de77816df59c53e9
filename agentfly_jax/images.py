"""Images for Qwen2-VL-style policies: loading with clear errors, and the image processor's pixels and token counts.

A vision-language policy (Qwen2-VL, Qwen2.5-VL) sees an image as `<|vision_start|>`, one `<|image_pad|>` per
merged patch, `<|vision_end|>`; the vision tower reads the image's patches. Training must see exactly what the
served model sees, so everything here reproduces transformers' `Qwen2VLImageProcessorPil` (the processor that
vLLM and `Qwen2_5_VLProcessor` use):

- `load_image` turns what a dataset row or a tool gives (a PIL image, a numpy array, a path, raw bytes, a data
  URL, a chat content part) into an RGB PIL image the way transformers does: `Image.convert("RGB")` for every
  mode (alpha is dropped, not composited; palettes are expanded; CMYK and YCbCr are converted), and files
  decoded from a path, bytes or a data URL are turned upright by their EXIF orientation first (transformers'
  `load_image`; an image given as a PIL object is taken as it is, as the processor takes it). Anything that
  cannot be used raises `ImageError` saying what is wrong and what to do, and an encoded image's size is read
  from its header and checked against a pixel cap before any decoding (a small file can claim billions of
  pixels).
- `smart_resize` picks the processor's target size: both sides multiples of `patch_size * merge_size`, the
  pixel count within [min_pixels, max_pixels], the aspect ratio kept as closely as possible.
- `prepare_image` resizes once (PIL bicubic, as the processor) and keeps the result as uint8 pixels in a
  `PreparedImage`; its `pixel_values()` are the processor's: rescaled by 1/255, normalised with the CLIP
  mean/std, cut into `temporal_patch_size x patch_size x patch_size` patches (a still image repeated over the
  temporal patch) in the merge-window order of the vision tower.
- `preprocess(images)` is the processor's output for a list of images: `pixel_values` [total_patches,
  3 * temporal_patch_size * patch_size**2] float32 and `image_grid_thw` [n, 3].

Why a `PreparedImage` keeps the resized uint8 pixels rather than `pixel_values`: everything after the resize is
exact arithmetic on them, so they determine `pixel_values` exactly, at an eighth of the memory (one byte per
value instead of four, and no copy for the temporal repeat); rollouts keep every image of every chain until the
update, which builds the float patches for its batch only.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: The image placeholder token of Qwen2-VL / Qwen2.5-VL; the processor repeats it once per merged patch.
IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"

#: CLIP's normalisation, used by the Qwen2-VL image processor.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

#: transformers' Qwen2-VL image processor defaults: 4 to 1280 merged patches (tokens) per image.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
#: Most pixels an input image may have before it is decoded (or, for arrays, before it is resized).
DEFAULT_MAX_INPUT_PIXELS = 8192 * 8192
#: The processor refuses images whose long side is more than this many times the short side.
MAX_ASPECT_RATIO = 200

# Modes whose values may fall outside 0..255: Image.convert("RGB") clips them (a 16-bit image turns white).
_WIDE_MODES = ("I", "F", "I;16", "I;16L", "I;16B", "I;16N")


class ImageError(ValueError):
    """An image that cannot be used: unreadable, of an unsupported kind, empty, too large or malformed."""


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def image_source(obj: Any) -> Any:
    """The image inside a chat content part (`{"type": "image", "image": ...}`, `{"image_url": ...}` as a string
    or OpenAI's `{"url": ...}`, `{"url": ...}`, `{"path": ...}`); anything else is returned as it is."""
    if not isinstance(obj, Mapping):
        return obj
    for key in ("image", "image_url", "url", "path"):
        if key in obj and obj[key] is not None:
            value = obj[key]
            if key == "image_url" and isinstance(value, Mapping):
                if not isinstance(value.get("url"), str):
                    raise ImageError(f"an image_url part needs a string 'url', got {value!r}")
                return value["url"]
            return value
    raise ImageError(
        f"the content part {_short(obj)} holds no image: give {{'type': 'image', 'image': <PIL image, numpy "
        "array, path or bytes>}} (or {'image_url': <path or data: URL>})"
    )


def load_image(obj: Any, *, max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS):
    """An RGB PIL image from `obj`, converted as transformers' Qwen2-VL processor converts it.

    obj: a PIL image; a numpy array (HxW grayscale, HxWx1, HxWx3 RGB or HxWx4 RGBA, channels last; uint8, or
      floats in [0, 1], which become uint8 as transformers' `to_pil_image` makes them, i.e. x*255 truncated);
      a path (str or Path, or a `file://` URL); raw encoded bytes; a `data:image/...;base64,` URL; or a content
      part holding one of these (see `image_source`).
    max_input_pixels: the most pixels accepted; an encoded image is checked from its header, before decoding.
    Raises ImageError for anything unusable (unreadable or truncated data, unsupported mode, zero size, too many
    pixels, non-finite or out-of-range floats, wrong array shape or dtype, a URL to download).
    """
    from PIL import Image

    source = image_source(obj)
    if isinstance(source, Image.Image):
        return _to_rgb(source, max_input_pixels, "the PIL image")
    if isinstance(source, np.ndarray):
        return _to_rgb(_array_to_pil(source), max_input_pixels, "the array")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), max_input_pixels, f"the {len(source)} bytes")
    if isinstance(source, Path):
        return _decode_file(source, max_input_pixels)
    if isinstance(source, str):
        if source.startswith("data:"):
            return _decode(_data_url_bytes(source), max_input_pixels, "the data URL")
        if source.startswith(("http://", "https://")):
            raise ImageError(
                f"the image {_short(source)} is a web URL; images are not downloaded during rollouts: download it "
                "and give its path or bytes"
            )
        return _decode_file(Path(source.removeprefix("file://")), max_input_pixels)
    raise ImageError(
        f"cannot read an image from a {type(source).__name__}: give a PIL image, a numpy array (HxW, HxWx3 or "
        "HxWx4), a path, encoded bytes or a data: URL"
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _data_url_bytes(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ImageError(
            f"the data URL {_short(url, 40)} is not base64 encoded: write it as data:image/<format>;base64,<data>"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"the data URL's base64 payload cannot be decoded ({error})") from error


def _decode_file(path: Path, max_input_pixels: int):
    if not path.is_file():
        raise ImageError(f"no image file at {str(path)!r}: give an existing path (or the image's bytes)")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ImageError(f"cannot read the image file {str(path)!r}: {error}") from error
    return _decode(data, max_input_pixels, f"the file {str(path)!r}")


def _decode(data: bytes, max_input_pixels: int, what: str):
    """Decode encoded image bytes: header first (size checked against the cap), then the pixels."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise ImageError(f"{what}: no image data (empty)")
    try:
        with warnings.catch_warnings():
            # the cap below is the guard; PIL's own warning for large images would only repeat it
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:
        raise ImageError(f"{what}: the image claims too many pixels to decode safely ({error})") from error
    except UnidentifiedImageError as error:
        raise ImageError(f"{what}: not an image PIL can read (corrupt data or an unsupported format)") from error
    except (OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"{what}: not an image PIL can read ({type(error).__name__}: {error})") from error
    _check_size(image.width, image.height, max_input_pixels, what)
    try:
        image.load()
        image = ImageOps.exif_transpose(image)  # as transformers' load_image: files are shown upright
    except Exception as error:  # PIL raises OSError, SyntaxError, ValueError, ... for bad data
        raise ImageError(
            f"{what}: cannot be decoded (truncated or corrupt image data): {type(error).__name__}: {error}"
        ) from error
    return _to_rgb(image, max_input_pixels, what)


def _check_size(width: int, height: int, max_input_pixels: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{what}: the image is empty ({width}x{height} pixels); it needs at least one pixel")
    if width * height > max_input_pixels:
        raise ImageError(
            f"{what}: the image is {width}x{height} = {width * height} pixels, more than the cap of "
            f"{max_input_pixels}: downscale it first (it is resized to at most max_pixels anyway) or raise "
            "max_input_pixels"
        )


def _to_rgb(image, max_input_pixels: int, what: str):
    """`image.convert("RGB")`, as transformers converts every non-RGB image, after the checks."""
    _check_size(image.width, image.height, max_input_pixels, what)
    try:
        image.load()  # a lazily opened image decodes here
    except Exception as error:  # see _decode
        raise ImageError(
            f"{what}: cannot be decoded (truncated or corrupt image data): {type(error).__name__}: {error}"
        ) from error
    if image.mode == "RGB":
        return image
    if image.mode in _WIDE_MODES:
        low, high = image.getextrema()
        if low < 0 or high > 255:
            raise ImageError(
                f"{what}: the image is in mode {image.mode!r} with values from {low} to {high}; converting it to "
                "RGB (as transformers does) would clip them to 0..255: scale it to 8 bits yourself (e.g. mode 'L' "
                "or 'RGB') with the mapping you intend"
            )
    try:
        return image.convert("RGB")
    except ValueError as error:
        raise ImageError(
            f"{what}: the image is in mode {image.mode!r}, which PIL cannot convert to RGB ({error}): convert it "
            "to 'RGB' or 'RGBA' first"
        ) from error


def _array_to_pil(array: np.ndarray):
    """The PIL image of a channels-last array; floats in [0, 1] become uint8 as transformers' `to_pil_image`."""
    from PIL import Image

    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        hint = ""
        if array.ndim == 3 and array.shape[0] in (1, 3, 4):
            hint = "; it looks channels-first: give array.transpose(1, 2, 0)"
        raise ImageError(
            f"an image array must be HxW (grayscale), HxWx3 (RGB) or HxWx4 (RGBA), channels last; got shape "
            f"{tuple(array.shape)}{hint}"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageError(f"the array: the image is empty ({array.shape[1]}x{array.shape[0]} pixels)")
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise ImageError("the image array holds NaN or infinite values: give finite floats in [0, 1]")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 1.0:
            raise ImageError(
                f"a float image array must hold values in [0, 1], got [{low}, {high}]: divide 0..255 values by "
                "255 or give them as uint8"
            )
        # transformers' to_pil_image: rescale(image, 255) (float64 product, stored as float32), then astype(uint8)
        array = (array.astype(np.float64) * 255).astype(np.float32).astype(np.uint8)
    elif array.dtype != np.uint8:
        raise ImageError(
            f"an image array must be uint8 (0..255) or float (0..1), got dtype {array.dtype}: convert it, e.g. "
            "array.astype(np.uint8) for 0..255 integers"
        )
    mode = {2: "L", 3: "RGB", 4: "RGBA"}[array.ndim if array.ndim == 2 else array.shape[-1]]
    return Image.fromarray(np.ascontiguousarray(array), mode=mode)


# --------------------------------------------------------------------------------------------------
# Resizing and pixel values
# --------------------------------------------------------------------------------------------------


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """The Qwen2-VL processor's target (height, width): multiples of `factor`, min_pixels <= h*w <= max_pixels
    (up to the rounding to `factor`), aspect ratio as close as possible.

    Each side is rounded to the nearest multiple of `factor` (Python's round: halves to even); if that has more
    than max_pixels, both sides are scaled down by the same factor and rounded down, if fewer than min_pixels
    scaled up and rounded up. Raises ImageError for an empty image or one more than MAX_ASPECT_RATIO times as
    long as it is wide (the processor refuses those).
    """
    if height < 1 or width < 1:
        raise ImageError(f"cannot resize an empty image ({width}x{height} pixels)")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"the image is {width}x{height} pixels, an aspect ratio of {max(height, width) / min(height, width):.1f}; "
            f"the Qwen2-VL processor accepts at most {MAX_ASPECT_RATIO}: crop or pad it first"
        )
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    if resized_height * resized_width > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        resized_height = max(factor, math.floor(height / scale / factor) * factor)
        resized_width = max(factor, math.floor(width / scale / factor) * factor)
    elif resized_height * resized_width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        resized_height = math.ceil(height * scale / factor) * factor
        resized_width = math.ceil(width * scale / factor) * factor
    return resized_height, resized_width


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    """How images are sized and cut into patches (the Qwen2-VL image processor's settings; its defaults).

    min_pixels, max_pixels: the pixel range an image is resized into (tokens per image: pixels / 28**2).
    patch_size, temporal_patch_size, merge_size: the vision tower's patch geometry.
    max_input_pixels: the most pixels an input image may have (checked before decoding).
    """

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"ImageSettings.{field.name} must be a positive int, got {value!r}")
            object.__setattr__(self, field.name, int(value))
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"ImageSettings.min_pixels={self.min_pixels} is more than max_pixels={self.max_pixels}"
            )

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of: one merge window of patches."""
        return self.patch_size * self.merge_size


class PreparedImage:
    """One image resized for the vision tower: its uint8 pixels and patch geometry; `pixel_values()` on demand.

    pixels: [H, W, 3] uint8 (read-only), H and W multiples of patch_size * merge_size.
    Two PreparedImages are equal when their pixels and geometry are.
    """

    __slots__ = ("merge_size", "patch_size", "pixels", "temporal_patch_size")

    def __init__(self, pixels: np.ndarray, *, patch_size: int = 14, temporal_patch_size: int = 2,
                 merge_size: int = 2):
        pixels = np.asarray(pixels)
        factor = patch_size * merge_size
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
            raise ImageError(f"PreparedImage pixels must be [H, W, 3] uint8, got {pixels.dtype} {pixels.shape}")
        if pixels.shape[0] % factor or pixels.shape[1] % factor or not pixels.shape[0] or not pixels.shape[1]:
            raise ImageError(
                f"PreparedImage pixels are {pixels.shape[1]}x{pixels.shape[0]}; both sides must be positive "
                f"multiples of patch_size * merge_size = {factor} (resize with smart_resize)"
            )
        if pixels.flags.writeable:
            pixels = pixels.copy()
            pixels.flags.writeable = False
        self.pixels = pixels
        self.patch_size = int(patch_size)
        self.temporal_patch_size = int(temporal_patch_size)
        self.merge_size = int(merge_size)

    def __repr__(self) -> str:
        height, width, _ = self.pixels.shape
        return f"PreparedImage({width}x{height}, grid_thw={self.grid_thw}, tokens={self.num_tokens})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PreparedImage):
            return NotImplemented
        return (
            (self.patch_size, self.temporal_patch_size, self.merge_size)
            == (other.patch_size, other.temporal_patch_size, other.merge_size)
            and np.array_equal(self.pixels, other.pixels)
        )

    __hash__ = None  # equal by value, and mutable-looking: not a dict key

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(temporal, height, width) patches: (1, H / patch_size, W / patch_size) for a still image."""
        height, width, _ = self.pixels.shape
        return 1, height // self.patch_size, width // self.patch_size

    @property
    def num_patches(self) -> int:
        """Rows of `pixel_values()`."""
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """`<|image_pad|>` tokens standing for this image: one per merge window of patches."""
        return image_token_count(self.grid_thw, self.merge_size)

    def pixel_values(self) -> np.ndarray:
        """[num_patches, 3 * temporal_patch_size * patch_size**2] float32, exactly the processor's.

        Rescaled by 1/255 (in float64, stored as float32), normalised per channel with the CLIP mean/std (float32),
        then cut into patches: patch rows in the order (merge-window row, merge-window column, row in the window,
        column in the window), each patch flattened as (channel, temporal, y, x) with the still image repeated
        over the temporal axis.
        """
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        height, width, channels = self.pixels.shape
        values = (self.pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
        values = (values - np.asarray(OPENAI_CLIP_MEAN, np.float32)) / np.asarray(OPENAI_CLIP_STD, np.float32)
        # [H, W, C] -> (window row, row in window, y, window column, column in window, x, C)
        values = values.reshape(height // (p * m), m, p, width // (p * m), m, p, channels)
        values = values.transpose(0, 3, 1, 4, 6, 2, 5)  # (window row, window col, row, col, C, y, x)
        values = np.broadcast_to(values[:, :, :, :, :, None], (*values.shape[:5], t, p, p))
        return values.reshape(self.num_patches, channels * t * p * p)


def image_token_count(grid_thw: Sequence[int], merge_size: int = 2) -> int:
    """`<|image_pad|>` tokens of an image with patch grid (t, h, w): t * h * w / merge_size**2."""
    t, h, w = (int(n) for n in grid_thw)
    return t * h * w // (merge_size * merge_size)


def prepare_image(obj: Any, settings: ImageSettings | None = None) -> PreparedImage:
    """Load `obj` (see `load_image`) and resize it as the processor does (smart_resize, PIL bicubic)."""
    from PIL import Image

    settings = settings if settings is not None else ImageSettings()
    image = load_image(obj, max_input_pixels=settings.max_input_pixels)
    height, width = smart_resize(
        image.height, image.width, settings.factor, settings.min_pixels, settings.max_pixels
    )
    resized = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    return PreparedImage(
        np.asarray(resized, dtype=np.uint8),
        patch_size=settings.patch_size,
        temporal_patch_size=settings.temporal_patch_size,
        merge_size=settings.merge_size,
    )


def preprocess(
    images: Any,
    *,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS,
) -> tuple[np.ndarray, np.ndarray]:
    """The Qwen2-VL image processor's output for `images` (a list, or one image): `pixel_values`
    [total_patches, 3 * temporal_patch_size * patch_size**2] float32 (every image's patches, in order) and
    `image_grid_thw` [n, 3] int64."""
    settings = ImageSettings(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
        max_input_pixels=max_input_pixels,
    )
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise ImageError("preprocess() got no images")
    prepared = [prepare_image(image, settings) for image in images]
    return pixel_inputs(prepared)


def pixel_inputs(images: Sequence[PreparedImage]) -> tuple[np.ndarray, np.ndarray]:
    """(`pixel_values` [total_patches, patch_dim] float32, `image_grid_thw` [n, 3] int64) of prepared images."""
    if not images:
        raise ImageError("pixel_inputs() got no images")
    pixel_values = np.concatenate([image.pixel_values() for image in images], axis=0)
    grid_thw = np.array([image.grid_thw for image in images], dtype=np.int64).reshape(len(images), 3)
    return pixel_values, grid_thw
