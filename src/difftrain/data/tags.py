"""Merge WD14-style tag files and caption files into sd-scripts' finetune metadata JSON.

The output has the layout that kohya-ss/sd-scripts' ``finetune/merge_captions_to_metadata.py``
and ``finetune/merge_dd_tags_to_metadata.py`` write and that its fine-tuning dataset reads::

    {"<image key>": {"caption": "a photo of a cat", "tags": "1girl, solo, smile"}, ...}

The image key is the file stem (sd-scripts' default) or, with ``full_path``, ``str(path)`` of the
image as found under ``data_dir`` -- exactly what sd-scripts does with ``--full_path``
(``str(image_path)``, not resolved: the key is absolute only when ``data_dir`` is). A key only
gets the fields whose file exists and is non-empty; other fields and other keys of an existing
metadata file are kept.

Like sd-scripts, when ``in_json`` is not given and ``out_json`` already exists, ``out_json`` is
read and updated rather than overwritten. Unlike sd-scripts, two images that would share a key
(``a.png`` + ``a.jpg``, or equal stems in different sub-folders without ``full_path``) are an
error instead of a silent overwrite, and a missing tag/caption file is counted, never a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..utils import atomic_write_text

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")

_TAG_SEPARATORS = re.compile(r"[,\n\r]+")
_SPACES = re.compile(r"\s+")


@dataclass
class MergeReport:
    """What :func:`merge_tags` did. Lists hold image keys, in image order."""

    images: int
    with_tags: int
    with_caption: int
    missing_tags: list[str]
    missing_captions: list[str]
    out_path: Path
    read_from: Path | None = field(default=None)
    """The existing metadata file that was read and updated (``in_json``, or ``out_json`` when it existed)."""


def normalize_ext(ext: str) -> str:
    """Return ``ext`` with exactly one leading dot: ``"txt"`` and ``".txt"`` both give ``".txt"``."""
    cleaned = ext.strip()
    if not cleaned.lstrip("."):
        raise DataError(f"file extension {ext!r} is empty", hint="use e.g. '.txt' or '.caption'")
    return "." + cleaned.lstrip(".")


def normalize_tags(text: str) -> str:
    """Normalise a tag list to ``"a, b, c"``: split on commas/newlines, squeeze spaces, drop empties.

    Tag order and tag text are kept as written (no de-duplication, no underscore rewriting).
    """
    tags = (_SPACES.sub(" ", t).strip() for t in _TAG_SEPARATORS.split(text))
    return ", ".join(t for t in tags if t)


def list_images(data_dir: Path, recursive: bool = False) -> list[Path]:
    """Image files in ``data_dir`` (and its sub-folders if ``recursive``), sorted.

    Extensions (:data:`IMAGE_EXTS`) match case-insensitively, so ``A.PNG`` is found too.
    Hidden files and folders (name starting with ".") are left out: macOS' ``._name.jpg``
    resource forks are not images, and ``.difftrain-cache`` may live inside the data folder.
    Paths are ``data_dir``-joined, not resolved.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(
            f"data folder {data_dir} does not exist or is not a folder",
            hint="pass the folder that holds your images",
        )
    candidates = data_dir.rglob("*") if recursive else data_dir.iterdir()
    return sorted(p for p in candidates if p.suffix.lower() in IMAGE_EXTS and _visible(p, data_dir) and p.is_file())


def _visible(path: Path, data_dir: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(data_dir).parts)


def image_key(path: Path, full_path: bool) -> str:
    """The metadata key of an image: its stem, or ``str(path)`` with ``full_path`` (as sd-scripts)."""
    return str(path) if full_path else Path(path).stem


def read_text_file(path: Path) -> str | None:
    """Read a UTF-8 text file, dropping a BOM and surrounding whitespace; ``None`` if it is missing."""
    try:
        return Path(path).read_text(encoding="utf-8-sig").strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}", hint="check its permissions") from exc
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not valid UTF-8 text ({exc.reason} at byte {exc.start})",
            hint="re-save the file as UTF-8",
        ) from exc


def load_metadata(path: Path) -> dict[str, Any]:
    """Read a metadata JSON file that must hold one JSON object; :class:`DataError` otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise DataError(f"metadata file {path} does not exist", hint="check the path, or leave it out") from exc
    except OSError as exc:
        raise DataError(f"cannot read metadata file {path}: {exc.strerror or exc}", hint="check its permissions") from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"metadata file {path} is not UTF-8 text", hint="re-save it as UTF-8") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"metadata file {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            hint="fix the file, or delete it to start a fresh one",
        ) from exc
    if not isinstance(data, dict):
        raise DataError(
            f"metadata file {path} holds a JSON {type(data).__name__}, not an object of image keys",
            hint='expected {"image key": {"caption": ..., "tags": ...}, ...}',
        )
    return data


def write_metadata(path: Path, metadata: dict[str, Any]) -> None:
    """Write metadata as sd-scripts does (indent 2, key order kept), atomically."""
    atomic_write_text(Path(path), json.dumps(metadata, indent=2, ensure_ascii=False) + "\n")


def _keyed_images(images: list[Path], full_path: bool) -> list[tuple[str, Path]]:
    """Pair images with their keys; two images with one key are an error."""
    seen: dict[str, Path] = {}
    for img in images:
        key = image_key(img, full_path)
        if key in seen:
            raise DataError(
                f"{seen[key]} and {img} would share the metadata key {key!r}",
                hint="rename one of them" + ("" if full_path else ", or use full-path keys"),
            )
        seen[key] = img
    return list(seen.items())


def _entry(metadata: dict[str, Any], key: str, source: Path) -> dict[str, Any]:
    """The (possibly new) dict for ``key``; an existing non-object value is an error."""
    entry = metadata.setdefault(key, {})
    if not isinstance(entry, dict):
        raise DataError(
            f"metadata file {source}: the value of {key!r} is a {type(entry).__name__}, not an object",
            hint="fix or remove that entry",
        )
    return entry


def merge_tags(
    data_dir: Path,
    out_json: Path,
    *,
    tag_ext: str = ".txt",
    caption_ext: str = ".caption",
    in_json: Path | None = None,
    full_path: bool = False,
    recursive: bool = False,
) -> MergeReport:
    """Merge ``<stem><tag_ext>`` and ``<stem><caption_ext>`` files beside each image into ``out_json``.

    Reads ``in_json`` first (or ``out_json`` if it exists and ``in_json`` is not given), updates the
    ``"tags"``/``"caption"`` field of each image's key, keeps everything else, and writes ``out_json``
    atomically. Raises :class:`DataError` for a missing/empty data folder or a bad ``in_json``.
    """
    data_dir, out_json = Path(data_dir), Path(out_json)
    tag_ext, caption_ext = normalize_ext(tag_ext), normalize_ext(caption_ext)
    images = list_images(data_dir, recursive)
    if not images:
        raise DataError(
            f"no images ({', '.join(IMAGE_EXTS)}) in {data_dir}" + ("" if recursive else " (sub-folders not searched)"),
            hint="check the folder" + ("" if recursive else ", or search sub-folders with recursive"),
        )
    keyed = _keyed_images(images, full_path)

    read_from = Path(in_json) if in_json is not None else (out_json if out_json.is_file() else None)
    metadata = load_metadata(read_from) if read_from is not None else {}

    report = MergeReport(len(keyed), 0, 0, [], [], out_json, read_from)
    for key, img in keyed:
        entry = _entry(metadata, key, read_from or out_json)
        caption = read_text_file(img.with_suffix(caption_ext)) or None
        tags = normalize_tags(read_text_file(img.with_suffix(tag_ext)) or "") or None
        if caption is None:
            report.missing_captions.append(key)
        else:
            entry["caption"] = caption
            report.with_caption += 1
        if tags is None:
            report.missing_tags.append(key)
        else:
            entry["tags"] = tags
            report.with_tags += 1

    write_metadata(out_json, metadata)
    return report
