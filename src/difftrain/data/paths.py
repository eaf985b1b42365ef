"""The dataset folder's paths, read as hostile: which files are images (and which media difftrain does not read),
whether a path stays inside the data folder (links followed), and reading a caption or tag file that may be a
link, a device or not UTF-8. Image and video datasets and merge-tags all read through these."""

from __future__ import annotations

import stat
from pathlib import Path

from ..errors import DataError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


#: image and video formats people keep beside their training images that difftrain does not read: found and said
#: (precompute's and merge-tags' summaries, precompute-report.json), never silently passed over
OTHER_MEDIA_EXTS = (
    ".gif",
    ".tif",
    ".tiff",
    ".avif",
    ".heic",
    ".heif",
    ".jxl",
    ".jp2",
    ".psd",
    ".tga",
    ".ico",
    ".svg",
    ".mp4",
    ".webm",
    ".mov",
    ".mkv",
    ".avi",
)


OUTSIDE_HINT = (
    "move the file into the data folder, or set data.allow_outside_paths: true (merge-tags: --allow-outside-paths) "
    "if you trust this dataset"
)


def normalize_ext(ext: str) -> str:
    """Return ``ext`` with exactly one leading dot: ``"txt"`` and ``".txt"`` both give ``".txt"``."""
    cleaned = ext.strip()
    if not cleaned.lstrip("."):
        raise DataError(f"file extension {ext!r} is empty", hint="use e.g. '.txt' or '.caption'")
    return "." + cleaned.lstrip(".")


def _visible(path: Path, data_dir: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(data_dir).parts)


def is_inside(path: Path, root: Path) -> bool:
    """Whether ``path``, its links followed and ``..`` resolved, lies in ``root``."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def check_inside(path: Path, root: Path) -> None:
    """:class:`DataError` when ``path`` (in ``root``, or a symbolic link there) leads outside ``root``.

    A dataset someone else made may hold links to any file of yours (``a.txt -> ~/.ssh/id_rsa``); a caption
    read through one would end up in a metadata file and in the trained model. Links inside the folder are fine."""
    if not is_inside(path, root):
        raise DataError(f"{path} leads to {Path(path).resolve()}, outside the data folder {root}", hint=OUTSIDE_HINT)


def list_images(data_dir: Path, recursive: bool = False, allow_outside: bool = False) -> list[Path]:
    """Image files in ``data_dir`` (and its sub-folders if ``recursive``), sorted.

    Extensions (:data:`IMAGE_EXTS`) match case-insensitively, so ``A.PNG`` is found too.
    Hidden files and folders (name starting with ".") are left out: macOS' ``._name.jpg``
    resource forks are not images, and ``.difftrain-cache`` may live inside the data folder.
    Paths are ``data_dir``-joined, not resolved. Links to folders are not followed; a link to a
    file outside ``data_dir`` is a :class:`DataError` unless ``allow_outside`` (see :func:`check_inside`).
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(
            f"data folder {data_dir} does not exist or is not a folder",
            hint="pass the folder that holds your images",
        )
    candidates = data_dir.rglob("*") if recursive else data_dir.iterdir()
    images = sorted(p for p in candidates if p.suffix.lower() in IMAGE_EXTS and _visible(p, data_dir) and p.is_file())
    for p in images if not allow_outside else ():
        check_inside(p, data_dir)
    return images


def unused_media(data_dir: Path, recursive: bool = False) -> list[tuple[Path, str]]:
    """Files in ``data_dir`` with an image or video extension difftrain's image datasets do not read, each with
    the reason (``list_images``' rules for hidden files)."""
    data_dir = Path(data_dir)
    candidates = data_dir.rglob("*") if recursive else data_dir.iterdir()
    found = sorted(
        p for p in candidates if p.suffix.lower() in OTHER_MEDIA_EXTS and _visible(p, data_dir) and p.is_file()
    )
    read = ", ".join(e.lstrip(".") for e in IMAGE_EXTS)
    videos = (".mp4", ".webm", ".mov", ".mkv", ".avi")

    def why(p: Path) -> str:
        if p.suffix.lower() in videos:
            return f"a video: image datasets read stills ({read}); the video families (cogvideox) read clips"
        return f"{p.suffix.lower()} is not a format difftrain reads ({read}): convert it to PNG"

    return [(p, why(p)) for p in found]


def read_text_file(path: Path, root: Path | None = None) -> str | None:
    """Read a UTF-8 text file, dropping a BOM and surrounding whitespace; ``None`` if it is missing.

    A device, pipe or socket is a :class:`DataError` (``a.txt -> /dev/zero`` would never end); with ``root``, so
    is a file that leads outside ``root`` (:func:`check_inside`)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            return None
        if not stat.S_ISREG(mode):
            raise DataError(
                f"{path} is not a regular file (a device, pipe or socket?)", hint="remove it from the data folder"
            )
        if root is not None:
            check_inside(path, root)
        return path.read_text(encoding="utf-8-sig").strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}", hint="check its permissions") from exc
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not valid UTF-8 text ({exc.reason} at byte {exc.start})",
            hint="re-save the file as UTF-8",
        ) from exc
