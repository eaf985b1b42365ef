"""Merge WD14-style tag files and caption files into sd-scripts' finetune metadata JSON.

The output has the layout that kohya-ss/sd-scripts' ``finetune/merge_captions_to_metadata.py``
and ``finetune/merge_dd_tags_to_metadata.py`` write and that its fine-tuning dataset reads::

    {"<image key>": {"caption": "a photo of a cat", "tags": "1girl, solo, smile"}, ...}

The image key is the file stem (sd-scripts' default) or, with ``full_path``, ``str(path)`` of the
image as found under ``data_dir`` -- exactly what sd-scripts does with ``--full_path``
(``str(image_path)``, not resolved: the key is absolute only when ``data_dir`` is). A key only
gets the fields whose file exists and is non-empty; other fields and other keys of an existing
metadata file are kept.

Tag rules (:class:`TagRules`, the ``merge-tags`` options): scores written as ``tag:0.83`` or in the
WD14 CSV layout (``tag,0.83`` per line, optionally under a ``tag,confidence`` header) are read, and
tags under ``threshold`` dropped; ``drop`` lists unwanted tags (compared case-, underscore- and
space-insensitively); duplicates are removed keeping the first; order is kept; ``underscores``
turns ``long_hair`` into ``long hair`` but leaves kaomoji such as ``^_^`` alone; WD14's rating tags
(``general``, ``sensitive``, ``questionable``, ``explicit``, ``rating:*``) are kept or dropped; and
``caption_from`` writes the caption from the tags, the caption file, or both joined by ``separator``.

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
from .paths import IMAGE_EXTS, list_images, normalize_ext, read_text_file, unused_media

_TAG_SEPARATORS = re.compile(r"[,\n\r]+")
_SPACES = re.compile(r"\s+")


#: WD14 tagger's kaomoji (sd-scripts' tag_images_by_wd14_tagger.py keeps their underscores)
KAOMOJI = {
    "0_0",
    "(o)_(o)",
    "+_+",
    "+_-",
    "._.",
    "<o>_<o>",
    "<|>_<|>",
    "=_=",
    ">_<",
    "3_3",
    "6_9",
    ">_o",
    "@_@",
    "^_^",
    "o_o",
    "u_u",
    "x_x",
    "|_|",
    "||_||",
}
#: WD14's rating tags, and the prefixes other taggers give them
RATINGS = {"general", "sensitive", "questionable", "explicit", "safe", "nsfw"}
_SCORE = re.compile(r"^(?P<tag>.*?):(?P<score>[01](?:\.\d+)?|\.\d+)$")


@dataclass
class TagRules:
    """How tag files become the tag list: see the module docstring. The defaults only tidy (dedupe)."""

    drop: frozenset[str] = frozenset()
    dedupe: bool = True
    threshold: float | None = None
    underscores: bool = False
    ratings: str = "keep"  # keep | drop
    caption_from: str | None = None  # None (caption file only) | tags | caption | both
    separator: str = ", "

    def __post_init__(self) -> None:
        if self.ratings not in ("keep", "drop"):
            raise DataError(f"ratings must be keep or drop, not {self.ratings!r}")
        if self.caption_from not in (None, "tags", "caption", "both"):
            raise DataError(f"caption-from must be tags, caption or both, not {self.caption_from!r}")
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            raise DataError(f"the confidence threshold must be between 0 and 1, not {self.threshold}")
        object.__setattr__(self, "drop", frozenset(_canon(t) for t in self.drop))


def _canon(tag: str) -> str:
    """The form tags are compared in: lower case, underscores as spaces, single spaces."""
    return _SPACES.sub(" ", tag.replace("_", " ")).strip().lower()


def _is_rating(tag: str) -> bool:
    """``general`` / ``explicit`` / ... (WD14), or any ``rating:x`` / ``rating_x`` tag (other taggers, boorus)."""
    c = _canon(tag)
    return c in RATINGS or c.startswith(("rating:", "rating "))


def parse_tag_file(text: str) -> list[tuple[str, float | None]]:
    """(tag, score or None) in file order: ``a, b:0.8`` lists, or the WD14 CSV layout (``tag,score`` lines)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if lines and lines[0].replace(" ", "").lower() in ("tag,confidence", "name,score", "tag,score", "name,confidence"):
        lines = lines[1:]
        csv = True
    else:
        csv = len(lines) > 1 and all(_csv_row(ln) for ln in lines)
    if csv:
        rows = [_csv_pair(ln) for ln in lines]
        return [(t, v) for t, v in rows if t]
    out: list[tuple[str, float | None]] = []
    for raw in _TAG_SEPARATORS.split(text):
        tag = _SPACES.sub(" ", raw).strip()
        if not tag:
            continue
        m = _SCORE.match(tag)
        out.append((m["tag"].strip(), float(m["score"])) if m and m["tag"].strip() else (tag, None))
    return out


def _csv_pair(line: str) -> tuple[str, float | None]:
    """``tag,score`` -> (tag, score); a line without a number after its last comma is a tag without a score."""
    tag, sep, value = line.rpartition(",")
    try:
        return (tag.strip(), float(value)) if sep else (line, None)
    except ValueError:
        return line, None


def _csv_row(line: str) -> bool:
    tag, sep, value = line.rpartition(",")
    if not sep or not tag.strip():
        return False
    try:
        return 0.0 <= float(value) <= 1.0
    except ValueError:
        return False


def apply_rules(pairs: list[tuple[str, float | None]], rules: TagRules) -> list[str]:
    """The tags that survive the rules, in order, rewritten as asked."""
    out, seen = [], set()
    for tag, score in pairs:
        if rules.threshold is not None and score is not None and score < rules.threshold:
            continue
        c = _canon(tag)
        if c in rules.drop or (rules.ratings == "drop" and _is_rating(tag)):
            continue
        if rules.dedupe:
            if c in seen:
                continue
            seen.add(c)
        if rules.underscores and tag not in KAOMOJI:
            tag = tag.replace("_", " ")
        out.append(tag)
    return out


def read_drop_list(items: list[str]) -> frozenset[str]:
    """``--drop-tags`` values: tags, comma lists, or ``@file`` / existing file paths with one or more tags per line."""
    tags: list[str] = []
    for item in items:
        path = Path(item[1:]) if item.startswith("@") else Path(item)
        text = read_text_file(path) if (item.startswith("@") or path.is_file()) else item
        if text is None:
            raise DataError(f"drop-tags file {path} does not exist", hint="give tags, or the path of a file of tags")
        tags += [t.strip() for t in _TAG_SEPARATORS.split(text) if t.strip()]
    return frozenset(tags)


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
    changes: list[tuple[str, dict, dict]] = field(default_factory=list)
    """(key, fields before, fields after) of every entry that changed."""
    tags_removed: int = 0
    """Tags dropped by the rules (threshold, drop list, duplicates, ratings)."""
    unused: list[tuple[Path, str]] = field(default_factory=list)
    """Files with an image or video extension difftrain does not read (:func:`unused_media`), with the reason."""
    written: bool = True


def normalize_tags(text: str) -> str:
    """Normalise a tag file to ``"a, b, c"``: split on commas/newlines, squeeze spaces, drop empties and
    scores (``tag:0.83``, or the WD14 CSV layout: see :func:`parse_tag_file`).

    Tag order and tag text are kept as written (no de-duplication, no underscore rewriting).
    """
    return ", ".join(tag for tag, _ in parse_tag_file(text))


def image_key(path: Path, full_path: bool) -> str:
    """The metadata key of an image: its stem, or ``str(path)`` with ``full_path`` (as sd-scripts)."""
    return str(path) if full_path else Path(path).stem


def load_metadata(path: Path) -> dict[str, Any]:
    """Read a metadata JSON file that must hold one JSON object; :class:`DataError` otherwise."""
    path = Path(path)
    try:
        if path.exists() and not path.is_file():  # a device or pipe would never end
            raise DataError(f"metadata file {path} is not a regular file", hint="give the merge-tags JSON file")
        text = path.read_text(encoding="utf-8-sig")
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise DataError(f"metadata file {path} does not exist", hint="check the path, or leave it out") from exc
    except OSError as exc:
        raise DataError(
            f"cannot read metadata file {path}: {exc.strerror or exc}", hint="check its permissions"
        ) from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"metadata file {path} is not UTF-8 text", hint="re-save it as UTF-8") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"metadata file {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            hint="fix the file, or delete it to start a fresh one",
        ) from exc
    except RecursionError:
        raise DataError(
            f"metadata file {path} nests too deeply to read",
            hint='expected {"image key": {"caption": ..., "tags": ...}, ...}',
        ) from None
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
    rules: TagRules | None = None,
    dry_run: bool = False,
    allow_outside: bool = False,
) -> MergeReport:
    """Merge ``<stem><tag_ext>`` and ``<stem><caption_ext>`` files beside each image into ``out_json``.

    Reads ``in_json`` first (or ``out_json`` if it exists and ``in_json`` is not given), updates the
    ``"tags"``/``"caption"`` field of each image's key, keeps everything else, and writes ``out_json``
    atomically (not at all with ``dry_run``: the report's ``changes`` say what would change). Raises
    :class:`DataError` for a missing/empty data folder, a bad ``in_json``, or (unless ``allow_outside``) an image
    or text file that is a link to a file outside ``data_dir``.
    """
    rules = rules or TagRules()
    data_dir, out_json = Path(data_dir), Path(out_json)
    tag_ext, caption_ext = normalize_ext(tag_ext), normalize_ext(caption_ext)
    images = list_images(data_dir, recursive, allow_outside)
    if not images:
        raise DataError(
            f"no images ({', '.join(IMAGE_EXTS)}) in {data_dir}" + ("" if recursive else " (sub-folders not searched)"),
            hint="check the folder" + ("" if recursive else ", or search sub-folders with recursive"),
        )
    root = None if allow_outside else data_dir
    keyed = _keyed_images(images, full_path)

    read_from = Path(in_json) if in_json is not None else (out_json if out_json.is_file() else None)
    metadata = load_metadata(read_from) if read_from is not None else {}

    report = MergeReport(len(keyed), 0, 0, [], [], out_json, read_from, unused=unused_media(data_dir, recursive))
    for key, img in keyed:
        entry = _entry(metadata, key, read_from or out_json)
        before = {k: entry[k] for k in ("caption", "tags") if k in entry}
        caption = read_text_file(img.with_suffix(caption_ext), root) or None
        pairs = parse_tag_file(read_text_file(img.with_suffix(tag_ext), root) or "")
        kept = apply_rules(pairs, rules)
        report.tags_removed += len(pairs) - len(kept)
        tags = ", ".join(kept) or None
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
        if rules.caption_from == "tags" and tags:
            entry["caption"] = tags
        elif rules.caption_from == "both" and (caption or tags):
            entry["caption"] = rules.separator.join(x for x in (caption, tags) if x)
        after = {k: entry[k] for k in ("caption", "tags") if k in entry}
        if after != before:
            report.changes.append((key, before, after))

    if dry_run:
        report.written = False
    else:
        write_metadata(out_json, metadata)
    return report
