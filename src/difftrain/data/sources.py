"""A training set of images and captions read from a folder, and a robust RGB image loader.

:func:`scan_dataset` lists the images under a folder, reads each one's size from its header and
resolves its caption, either from a merge-tags metadata JSON (see :mod:`difftrain.data.tags`) or
from the ``<stem><caption_ext>`` / ``<stem><tag_ext>`` files beside the image. Unreadable images are
returned as ``(path, reason)`` instead of raising, so one bad file never stops a run.

Sizes honour the EXIF orientation tag (a portrait phone photo stored sideways is reported, and
loaded by :func:`load_rgb`, upright); both use the same orientation reading, so a record's size
always equals the loaded image's size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from PIL import Image

from ..errors import DataError
from .paths import IMAGE_EXTS, list_images, normalize_ext, read_text_file, unused_media
from .tags import load_metadata, normalize_tags

CaptionSource = Literal["caption_then_tags", "caption_and_tags", "tags"]
CAPTION_SOURCES: tuple[str, ...] = ("caption_then_tags", "caption_and_tags", "tags")

_ORIENTATION_TAG = 0x0112
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_SIDES = (5, 6, 7, 8)
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_WHITE = (255, 255, 255, 255)


@dataclass(frozen=True)
class ImageRecord:
    """One training image."""

    key: str
    """Path relative to the data folder, without extension, '/'-separated: stable and unique."""
    path: Path
    caption: str
    width: int
    """Upright width (EXIF orientation applied), from the header; the image is not decoded."""
    height: int
    caption_from: str = "caption"
    """Where the caption came from: ``caption``, ``tags``, ``caption+tags``, or, with neither, the fallback
    (``filename`` or ``empty``); counted in the precompute report."""
    mode: str = "RGB"
    """Pillow's pixel mode from the header (``CMYK``, ``P``, ``RGBA``, ``I;16`` ... are converted to RGB)."""
    references: tuple[Path, ...] = ()
    """Edit training: the reference images the target is made from (data/pairs.py), in order; none otherwise."""
    subset: str = ""
    """The subset it was read from (:mod:`.subsets`; "" for data.dir read as one folder)."""


# ----------------------------------------------------------------- captions
def check_caption_source(source: str) -> None:
    """``ValueError`` unless ``source`` is one of :data:`CAPTION_SOURCES`."""
    if source not in CAPTION_SOURCES:
        raise ValueError(f"caption_source must be one of {', '.join(CAPTION_SOURCES)}; got {source!r}")


def caption_for(caption: str | None, tags: str | None, source: str = "caption_then_tags") -> str:
    """Combine an image's caption and tags (``None`` or ``""`` = absent) into its training caption.

    * ``caption_then_tags``: the caption, or the tags when there is no caption;
    * ``caption_and_tags``: ``caption + ", " + tags`` (just the one present if only one is);
    * ``tags``: the tags only.

    Neither present gives ``""``.
    """
    return caption_with_origin(caption, tags, source)[0]


def caption_with_origin(caption: str | None, tags: str | None, source: str = "caption_then_tags") -> tuple[str, str]:
    """:func:`caption_for`, and which of the two it used: ``caption``, ``tags``, ``caption+tags``, or ``""``."""
    check_caption_source(source)
    caption, tags = (caption or "").strip(), (tags or "").strip()
    if source == "tags":
        return tags, "tags" if tags else ""
    if source == "caption_and_tags" and caption and tags:
        return f"{caption}, {tags}", "caption+tags"
    return (caption, "caption") if caption else (tags, "tags" if tags else "")


CAPTION_FALLBACKS: tuple[str, ...] = ("empty", "filename")


def fallback_caption(path: Path, fallback: str) -> str:
    """The caption of an image with neither caption nor tags: ``""``, or its file name with ``_`` as spaces."""
    if fallback not in CAPTION_FALLBACKS:
        raise ValueError(f"caption_fallback must be one of {', '.join(CAPTION_FALLBACKS)}; got {fallback!r}")
    return "" if fallback == "empty" else " ".join(Path(path).stem.replace("_", " ").split())


def sidecar_texts(
    image_path: Path, caption_ext: str = ".caption", tag_ext: str = ".txt", root: Path | None = None
) -> tuple[str | None, str | None]:
    """``(caption, tags)`` from the files beside an image (``None`` where a file is missing); with ``root``, a file
    that is a link to a file outside ``root`` is a :class:`DataError`."""
    image_path = Path(image_path)
    caption = read_text_file(image_path.with_suffix(normalize_ext(caption_ext)), root)
    tags = read_text_file(image_path.with_suffix(normalize_ext(tag_ext)), root)
    return caption, (normalize_tags(tags) if tags is not None else None)


def _escapes(key: str, root: Path) -> bool:
    """Whether a metadata key names a path outside ``root``: absolute or with ``..``, and inside ``root`` neither
    relative to the working directory (sd-scripts' full-path keys) nor to ``root``."""
    if not (os.path.isabs(key) or ".." in key.replace("\\", "/").split("/")):
        return False
    roots = {os.path.abspath(root), os.path.realpath(root)}
    paths = {os.path.abspath(key), os.path.abspath(os.path.join(root, key))}
    return not any(os.path.commonpath([p, r]) == r for p in paths for r in roots)


def _abs_key(path: str | Path) -> str:
    """Absolute, normalised form of a path, computed without touching the disk."""
    return os.path.normcase(os.path.abspath(path))


class MetadataIndex:
    """Looks images up in a merge-tags metadata JSON by stem key or full-path key.

    Full-path keys written relative to the working directory (sd-scripts' ``--full_path`` with a
    relative folder) are matched against the image's absolute path too, as sd-scripts does.

    Keys are only compared with the images found in the data folder, never opened. Still, with ``root``
    given, a key that names a path outside it (absolute, or climbing out with ``..``) is a :class:`DataError`:
    such a file was made for another folder (its entries would silently match nothing) or by someone probing.
    """

    def __init__(self, metadata: dict[str, Any], source: Path | None = None, root: Path | None = None):
        self.metadata = metadata
        self.source = source
        self._by_abs = {_abs_key(k): k for k in metadata if Path(k).suffix.lower() in IMAGE_EXTS}
        if root is not None:
            for key in metadata:
                if _escapes(key, root):
                    raise DataError(
                        f"metadata file {source}: the entry {key!r} names a path outside the data folder {root}",
                        hint="fix or remove that entry (merge-tags keys images inside the folder), or set "
                        "data.allow_outside_paths: true if the file is yours",
                    )

    @classmethod
    def load(cls, path: Path, root: Path | None = None) -> MetadataIndex:
        """Read ``path`` (:class:`DataError` if it is missing or not a JSON object, or a key leads outside ``root``)."""
        return cls(load_metadata(Path(path)), Path(path), root)

    def key_for(self, image_path: Path) -> str | None:
        """The metadata key of ``image_path``: full path first, then absolute path, then stem."""
        for key in (str(image_path), self._by_abs.get(_abs_key(image_path)), Path(image_path).stem):
            if key is not None and key in self.metadata:
                return key
        return None

    def texts(self, image_path: Path) -> tuple[str | None, str | None] | None:
        """``(caption, tags)`` of ``image_path``, or ``None`` when the metadata has no entry for it."""
        key = self.key_for(image_path)
        if key is None:
            return None
        entry = self.metadata[key]
        if not isinstance(entry, dict):
            raise DataError(
                f"metadata file {self.source}: the value of {key!r} is a {type(entry).__name__}, not an object",
                hint='each entry must look like {"caption": "...", "tags": "..."}',
            )
        return self._text(entry, key, "caption"), self._text(entry, key, "tags")

    def _text(self, entry: dict[str, Any], key: str, name: str) -> str | None:
        value = entry.get(name)
        if value is None or isinstance(value, str):
            return value
        raise DataError(
            f"metadata file {self.source}: {key!r}.{name} is a {type(value).__name__}, not a string",
            hint="write captions and tags as strings (tags comma-separated)",
        )


# ----------------------------------------------------------------- image headers
def _exif_orientation(image: Image.Image) -> int:
    """EXIF orientation (1-8) read without decoding pixels; 1 when absent or unreadable.

    A PNG whose eXIf chunk sits after the pixel data would need a full decode to see it; such
    files are treated as upright both here and in :func:`load_rgb`, so sizes stay consistent.
    """
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    try:
        value = int(image.getexif().get(_ORIENTATION_TAG, 1))
    except Exception:  # noqa: BLE001 - a malformed EXIF block must not make the image unusable
        return 1
    return value if value in _TRANSPOSE else 1


def read_image_size(path: Path) -> tuple[int, int]:
    """Upright ``(width, height)`` from the file header. Raises what Pillow raises on a bad file."""
    return read_image_header(path)[:2]


class MultiFrame(ValueError):
    """An image file holding several frames (an animated WebP, a multi-page TIFF): which one is meant is unknown."""

    def __init__(self, frames: int):
        super().__init__(
            f"it holds {frames} frames (an animation or several pages): save the frame you mean as its own PNG"
        )


def read_image_header(path: Path) -> tuple[int, int, str]:
    """Upright ``(width, height, mode)`` from the file header. Raises what Pillow raises on a bad file, and
    :class:`MultiFrame` for a file of several frames."""
    with Image.open(path) as image:
        width, height = image.size
        orientation = _exif_orientation(image)
        mode = image.mode
        frames = getattr(image, "n_frames", 1)
    if frames > 1:
        raise MultiFrame(frames)
    if width <= 0 or height <= 0:
        raise ValueError(f"header gives an empty size {width}x{height}")
    return ((height, width) if orientation in _SWAPS_SIDES else (width, height)) + (mode,)


def image_header_or_reason(path: Path) -> tuple[int, int, str] | str:
    """:func:`read_image_header`'s ``(width, height, mode)``, or why the file is skipped (several frames, unreadable)."""
    try:
        return read_image_header(path)
    except MultiFrame as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad files
        return _unreadable_reason(path, exc)


def _unreadable_reason(path: Path, exc: BaseException | None = None) -> str:
    try:
        if path.stat().st_size == 0:
            return "empty file (0 bytes)"
    except OSError as stat_exc:
        return f"cannot read file: {stat_exc.strerror or stat_exc}"
    if isinstance(exc, Image.DecompressionBombError):
        return f"too many pixels for Pillow's safety limit: {exc}"
    return f"not a readable image: {exc}"


def record_key(path: Path, data_dir: Path) -> str:
    """Key of an image: its path relative to ``data_dir`` without extension, '/'-separated."""
    return Path(path).relative_to(data_dir).with_suffix("").as_posix()


# ----------------------------------------------------------------- scanning
def scan_dataset(
    data_dir: Path,
    *,
    metadata: Path | None = None,
    caption_ext: str = ".caption",
    tag_ext: str = ".txt",
    caption_source: str = "caption_then_tags",
    caption_fallback: str = "empty",
    recursive: bool = True,
    allow_outside: bool = False,
) -> tuple[list[ImageRecord], list[tuple[Path, str]]]:
    """Scan ``data_dir`` for images; return ``(records, skipped)`` with ``skipped = [(path, reason)]``.

    Captions come from ``metadata`` when it has an entry for the image (stem key or full-path
    key); images it lacks, and every image when ``metadata`` is ``None``, use the sidecar files
    ``<stem><caption_ext>`` and ``<stem><tag_ext>``. ``caption_source`` combines the two
    (:func:`caption_for`); no caption at all gives ``caption_fallback`` (:func:`fallback_caption`). Each
    record says where its caption came from (``caption_from``) and its header's pixel mode.

    An image is skipped (not raised) when its header cannot be read -- empty, corrupt, not an
    image -- or when it has the same key as an earlier image (``a.png`` beside ``a.jpg``).
    Only the header is read here (``Image.open`` parses it without decoding pixels; ``verify()``
    would read every file in full yet still miss most JPEG/WebP damage), so scanning a large
    folder stays fast. A file with a good header but damaged pixel data is caught when
    :func:`load_rgb` decodes it, which raises :class:`DataError` naming the file.

    Raises :class:`DataError` when ``data_dir`` does not exist or holds no image files, or when
    ``metadata`` cannot be read; ``ValueError`` for an unknown ``caption_source``. Unless ``allow_outside``,
    also for an image or caption/tag file that is a link to a file outside ``data_dir``, and for a metadata
    key naming a path outside it (see :class:`MetadataIndex`): a dataset made by someone else cannot make
    difftrain read your other files.
    """
    check_caption_source(caption_source)
    data_dir = Path(data_dir)
    caption_ext, tag_ext = normalize_ext(caption_ext), normalize_ext(tag_ext)
    images = list_images(data_dir, recursive, allow_outside)
    root = None if allow_outside else data_dir
    if not images:
        raise DataError(
            f"no images ({', '.join(IMAGE_EXTS)}) in {data_dir}" + ("" if recursive else " (sub-folders not searched)"),
            hint="check data.dir",
        )
    index = MetadataIndex.load(metadata, root) if metadata is not None else None

    records: list[ImageRecord] = []
    skipped: list[tuple[Path, str]] = unused_media(data_dir, recursive)  # formats difftrain does not read
    seen: dict[str, Path] = {}
    for path in images:
        key = record_key(path, data_dir)
        if key in seen:
            skipped.append((path, f"same name as {seen[key].name} (key {key!r}); rename one of them"))
            continue
        header = image_header_or_reason(path)
        if isinstance(header, str):
            skipped.append((path, header))
            continue
        width, height, mode = header
        seen[key] = path
        texts = index.texts(path) if index is not None else None
        caption, tags = texts if texts is not None else sidecar_texts(path, caption_ext, tag_ext, root)
        text, origin = caption_with_origin(caption, tags, caption_source)
        if not origin:
            text = fallback_caption(path, caption_fallback)
        records.append(ImageRecord(key, path, text, width, height, origin or caption_fallback, mode))
    return records, skipped


# ----------------------------------------------------------------- decoding
def _int_to_l(image: Image.Image) -> Image.Image:
    """16/32-bit integer greyscale -> 8-bit 'L', scaled (not clipped) to 0..255."""
    is_16bit = image.mode.startswith("I;16")
    image = image.convert("I") if image.mode != "I" else image
    # one band: getextrema gives (min, max), not the pair per band its type also allows
    _, high = cast("tuple[float, float]", image.getextrema())
    if is_16bit or 255 < high <= 65535:
        scale = 1 / 257  # 65535 -> 255
    elif high > 65535:
        scale = 255 / high
    else:
        scale = 1.0
    return image.point(lambda v: v * scale).convert("L")


def _float_to_l(image: Image.Image) -> Image.Image:
    """Float greyscale -> 'L': 0..1 data is scaled by 255, larger ranges are scaled to fit."""
    _, high = cast("tuple[float, float]", image.getextrema())  # one band, as in _int_to_l
    scale = 255.0 if high <= 1.0 else (1.0 if high <= 255 else 255.0 / high)
    return image.point(lambda v: v * scale).convert("L")


def _composite_on_white(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")


def to_rgb(image: Image.Image) -> Image.Image:
    """A new 8-bit RGB image from any Pillow mode; transparency is composited on white.

    Handles 1, L, P (with or without transparency), LA/PA/RGBA (and premultiplied), CMYK, YCbCr,
    16/32-bit integer (I;16*, I) and float (F) greyscale.
    """
    if image.mode == "I" or image.mode.startswith("I;16"):
        image = _int_to_l(image)
    elif image.mode == "F":
        image = _float_to_l(image)
    palette_alpha = image.mode == "P" and image.palette is not None and image.palette.mode == "RGBA"
    if image.mode in _ALPHA_MODES or palette_alpha or image.info.get("transparency") is not None:
        return _composite_on_white(image)
    return image.convert("RGB")


def load_rgb(path: Path) -> Image.Image:
    """Fully decode an image file to upright 8-bit RGB (see :func:`to_rgb`).

    Raises :class:`DataError` naming the file when it cannot be opened or decoded (corrupt,
    truncated, not an image, or a pixel mode that has no RGB conversion).
    """
    try:
        with Image.open(path) as image:
            orientation = _exif_orientation(image)  # before load(): same rule as read_image_size
            image.load()
            if orientation in _TRANSPOSE:
                image = image.transpose(_TRANSPOSE[orientation])
            return to_rgb(image)
    except Exception as exc:
        raise DataError(
            f"cannot decode image {path}: {exc}",
            hint="re-export the file, or remove it from the data folder",
        ) from exc
