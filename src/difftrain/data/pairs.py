"""Edit training data: each target image with its reference image(s) and instruction, in the layouts the peers use.

- ``data.control_dir``: a folder beside data.dir whose files have the targets' names (musubi-tuner's and ai-toolkit's
  ``control_directory``): ``dir/a.png`` pairs with ``control/a.jpg`` (any image extension). Several references of one
  target are numbered, ``control/a_0.png``, ``control/a_1.png`` (``a_0000.png`` too), in their numbers' order; or
  several control folders (a list), one reference from each, in the list's order. Sub-folders of data.dir are
  matched by their relative path. The caption (the instruction) is the target's, read as any caption.
- ``data.pairs``: a JSONL file (or a JSON list), one object per target: the target as ``image`` (``image_path``,
  ``target``), the references as ``control`` / ``control_images`` / ``edit_image`` (a path or a list: DiffSynth-Studio's
  and ai-toolkit's names), ``control_path`` or ``control_path_0``, ``control_path_1`` ... (musubi-tuner's), the
  instruction as ``caption`` (``prompt``, ``instruction``, ``text``). Relative paths are under data.dir.

A target whose reference is missing is skipped with the reason (precompute's report lists it); one whose reference
cannot be decoded is skipped when precompute decodes it. Every target of a dataset has the same number of references
(a batch stacks them): a target with another number is skipped with the reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import DataError
from .paths import IMAGE_EXTS, is_inside
from .sources import ImageRecord, image_header_or_reason, record_key

Skipped = list[tuple[Path, str]]

TARGET_KEYS = ("image", "image_path", "target")
CONTROL_KEYS = ("control", "control_images", "control_image", "edit_image", "control_path", "reference", "references")
CAPTION_KEYS = ("caption", "prompt", "instruction", "text")
_NUMBERED = re.compile(r"^control_path_(\d+)$")


def _images_named(folder: Path, stem: str) -> tuple[Path | None, list[tuple[int, Path]]]:
    """In ``folder``: the image named ``stem`` (any image extension), and those named ``stem_<n>`` with their n."""
    if not folder.is_dir():
        return None, []
    exact = None
    numbered: list[tuple[int, Path]] = []
    pattern = re.compile(re.escape(stem) + r"_(\d+)$")
    for f in folder.iterdir():
        if f.suffix.lower() not in IMAGE_EXTS or not f.is_file():
            continue
        if f.stem == stem:
            exact = f
        elif m := pattern.match(f.stem):
            numbered.append((int(m.group(1)), f))
    return exact, sorted(numbered)


def control_references(record: ImageRecord, data_dir: Path, control_dirs: Sequence[Path]) -> list[Path] | str:
    """The references of ``record`` in the control folder(s), or why there are none."""
    rel = Path(record.key)
    if len(control_dirs) == 1:
        folder = control_dirs[0] / rel.parent
        exact, numbered = _images_named(folder, rel.name)
        if exact is not None:
            return [exact]
        if numbered:
            numbers = [n for n, _ in numbered]
            gap = next((i for i, n in enumerate(numbers) if n != i), None)
            if gap is not None:
                return f"its reference {rel.name}_{gap}.* is missing from {folder} (found numbers {numbers})"
            return [f for _, f in numbered]
        return f"no reference image for it in {folder} (looked for {rel.name}.* and {rel.name}_0.*, {rel.name}_1.* ...)"
    refs = []
    for d in control_dirs:
        exact, _ = _images_named(d / rel.parent, rel.name)
        if exact is None:
            return f"no reference image {rel.name}.* in {d / rel.parent}"
        refs.append(exact)
    return refs


def with_control_dirs(
    records: list[ImageRecord], data_dir: Path, control_dirs: Sequence[Path]
) -> tuple[list[ImageRecord], Skipped]:
    """``records`` with their references from the control folder(s); those without, skipped with the reason."""
    for d in control_dirs:
        if not Path(d).is_dir():
            raise DataError(
                f"data.control_dir {d} is not a folder.",
                hint="Point data.control_dir at the folder of reference images (the same file names as data.dir's).",
            )
    out: list[ImageRecord] = []
    skipped: Skipped = []
    for r in records:
        refs = control_references(r, Path(data_dir), [Path(d) for d in control_dirs])
        if isinstance(refs, str):
            skipped.append((r.path, refs))
        else:
            out.append(replace(r, references=tuple(refs)))
    return out, skipped


def _read_lines(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed object) of a JSONL file, or of a JSON list's items (numbered from 1)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"Cannot read data.pairs {path}: {e}", hint="Give a UTF-8 JSONL file.") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"data.pairs {path} is not valid JSON: {e}", hint="Fix the file.") from None
        return list(enumerate(items, 1))
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(
                f"data.pairs {path} line {n} is not valid JSON: {e.msg}", hint="One JSON object per line (JSONL)."
            ) from None
    return out


def _pick(entry: dict, names: Sequence[str]) -> Any:
    return next((entry[k] for k in names if k in entry and entry[k] not in (None, "", [])), None)


def _controls(entry: dict) -> list[str]:
    numbered = sorted((int(m.group(1)), v) for k, v in entry.items() if (m := _NUMBERED.match(k)))
    if numbered:
        return [v for _, v in numbered]
    value = _pick(entry, CONTROL_KEYS)
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _resolve(value: Any, data_dir: Path, allow_outside: bool, where: str) -> Path:
    if not isinstance(value, str):
        raise DataError(f"{where}: a path is a string, not {type(value).__name__}.", hint="Fix the pairs file.")
    p = Path(value).expanduser()
    p = p if p.is_absolute() else data_dir / p
    if not allow_outside and not is_inside(p, data_dir):
        raise DataError(
            f"{where}: {value} is outside the data folder {data_dir}.",
            hint="Keep the images under data.dir, or set data.allow_outside_paths: true if you trust the file.",
        )
    return p


def scan_pairs(pairs: Path, data_dir: Path, allow_outside: bool = False) -> tuple[list[ImageRecord], Skipped]:
    """The targets of a pairs file as records with their references; a target or reference that is missing or
    unreadable is skipped with the reason. A malformed file (bad JSON, an object without a target) is an error."""
    data_dir = Path(data_dir)
    records: list[ImageRecord] = []
    skipped: Skipped = []
    seen: set[str] = set()
    for n, entry in _read_lines(Path(pairs)):
        where = f"data.pairs {pairs} line {n}"
        if not isinstance(entry, dict):
            raise DataError(f"{where} is a {type(entry).__name__}, not an object.", hint="One object per target.")
        target = _pick(entry, TARGET_KEYS)
        if target is None:
            raise DataError(f"{where} names no target image (keys: {', '.join(TARGET_KEYS)}).", hint="Add it.")
        path = _resolve(target, data_dir, allow_outside, where)
        refs = [_resolve(c, data_dir, allow_outside, where) for c in _controls(entry)]
        caption = _pick(entry, CAPTION_KEYS)
        if caption is not None and not isinstance(caption, str):
            raise DataError(f"{where}: the caption is a {type(caption).__name__}, not a string.", hint="Fix it.")
        if not path.is_file():
            skipped.append((path, f"{where}: the target image does not exist"))
            continue
        if not refs:
            skipped.append((path, f"{where}: no reference image (keys: {', '.join(CONTROL_KEYS)}, control_path_N)"))
            continue
        missing = [r for r in refs if not r.is_file()]
        if missing:
            skipped.append((path, f"{where}: the reference image {missing[0]} does not exist"))
            continue
        header = image_header_or_reason(path)
        if isinstance(header, str):
            skipped.append((path, header))
            continue
        width, height, mode = header
        key = record_key(path, data_dir) if is_inside(path, data_dir) else path.with_suffix("").as_posix()
        if key in seen:
            key = f"{key}#{n}"  # one target edited several ways: an item per line
        seen.add(key)
        records.append(
            ImageRecord(key, path, caption or "", width, height, "caption" if caption else "empty", mode, tuple(refs))
        )
    return records, skipped


def same_counts(records: Sequence[ImageRecord]) -> tuple[list[ImageRecord], Skipped]:
    """The targets with as many references as most (a training batch stacks them; of two counts as common, the
    larger), and the others skipped with the reason."""
    counts: dict[int, int] = {}
    for r in records:
        counts[len(r.references)] = counts.get(len(r.references), 0) + 1
    if len(counts) < 2:
        return list(records), []
    n = max(counts, key=lambda k: (counts[k], k))
    why = f"it has {{}} reference image(s) where the other pairs have {n} (a batch stacks them): give it {n}"
    return [r for r in records if len(r.references) == n], [
        (r.path, why.format(len(r.references))) for r in records if len(r.references) != n
    ]
