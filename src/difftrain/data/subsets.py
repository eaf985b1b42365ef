"""The folders a dataset is read from: data.dir as one folder, kohya's ``<repeats>_<name>`` layout, or data.subsets.

sd-scripts' DreamBooth layout (``train_data_dir/10_sks dog/*.png``): each sub-folder of the data folder is a subset
whose images are seen ``repeats`` times per epoch, and whose name part (``sks dog``) is the caption of an image that
has no caption or tag file (sd-scripts' ``class_tokens``). ``reg_data_dir`` holds regularisation images in the same
layout. :func:`resolve_subsets` decides which of the three a config means:

* ``data.subsets`` set: those folders (sd-scripts' and diffusion-pipe's dataset configs become these);
* else ``data.layout: kohya``, or ``auto`` with every image-holding sub-folder of data.dir named
  ``<digits>_<something>`` and no image at its top: one subset per folder;
* else data.dir as one folder, as before (its items' keys, and so the cache, are unchanged).

A folder that looks like the layout but is not (``10_`` without a name, ``0_x``, ``10_dog`` beside ``cats`` or
beside images at the top) is a :class:`DataError` saying what to rename, or to set ``data.layout: folder``.

This module names the folders only; the scans (:mod:`.sources`, :mod:`.video`) read them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..config.schema import DataConfig
from ..errors import DataError
from .paths import IMAGE_EXTS, OTHER_MEDIA_EXTS

#: sd-scripts' folder name: repeats, an underscore, the name (its ``train_util`` splits at the first ``_``)
KOHYA_FOLDER = re.compile(r"^(\d+)_(.*)$", re.DOTALL)
_MEDIA = IMAGE_EXTS + OTHER_MEDIA_EXTS
_LAYOUT_HINT = "rename it <repeats>_<name> (e.g. '10_sks dog'), or set data.layout: folder to read every image once"


@dataclass(frozen=True)
class Subset:
    """One folder of the dataset and how it is read."""

    name: str
    """Its name in the plan and in index.json ("" for data.dir read as one folder)."""
    dir: Path
    data: DataConfig
    """The data section as this folder sees it (a subset's own caption and bucket values over the section's)."""
    repeats: int = 1
    is_reg: bool = False
    class_tokens: str | None = None
    """The caption of an image with neither caption nor tags (kohya: the folder's name part)."""
    metadata: Path | None = None
    key_prefix: str = ""
    """Put before each item's key (its path in the folder), so keys stay distinct across subsets: the folder's
    name for kohya's layout (the keys data.dir read whole gives), ``<name>/`` for data.subsets, ``reg:`` before
    regularisation folders."""
    origin: str = "folder"
    """``folder``, ``kohya layout``, ``reg_dir`` or ``data.subsets``: said in the plan."""

    @property
    def caption_label(self) -> str:
        """What an image without caption or tags is captioned with, for the plan's table."""
        return "folder name" if self.origin in ("kohya layout", "reg_dir") else "class_tokens"


def _has_media(folder: Path) -> bool:
    return any(
        p.suffix.lower() in _MEDIA and p.is_file()
        for p in folder.rglob("*")
        if not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def media_folders(root: Path) -> tuple[list[Path], list[Path]]:
    """The visible sub-folders of ``root`` that hold images or videos (at any depth), and the media files at its
    top."""
    if not root.is_dir():
        raise DataError(f"data folder {root} does not exist or is not a folder", hint="pass the folder of your images")
    folders, top = [], []
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir() and not p.is_symlink() and _has_media(p):
            folders.append(p)
        elif p.is_file() and p.suffix.lower() in _MEDIA:
            top.append(p)
    return folders, top


def parse_kohya_name(name: str, where: Path) -> tuple[int, str]:
    """``(repeats, name part)`` of a ``<repeats>_<name>`` folder; :class:`DataError` for ``10_`` or ``0_x``."""
    m = KOHYA_FOLDER.match(name)
    if m is None:
        raise DataError(f"the folder {where} is not named <repeats>_<name>", hint=_LAYOUT_HINT)
    repeats, rest = int(m.group(1)), m.group(2).strip()
    if not rest:
        raise DataError(
            f"the folder {where} gives repeats ({m.group(1)}) but no name after the underscore",
            hint="add the name sd-scripts uses as the caption of images without one (e.g. '10_sks dog'), "
            "or set data.layout: folder",
        )
    if repeats < 1:
        raise DataError(
            f"the folder {where} asks for {repeats} repeats: its images would never be trained on",
            hint=f"use 1 or more (e.g. '1_{rest}'), move the folder out of the data folder, or set data.layout: "
            "folder to read every image once",
        )
    return repeats, rest


def kohya_folders(
    root: Path, forced: bool = False, what: str = "data.layout is kohya"
) -> list[tuple[Path, int, str]] | None:
    """``[(folder, repeats, name)]`` when ``root`` is in kohya's layout, None when it is not (nothing looks like
    it, and ``forced`` is off). :class:`DataError` when it half is: see the module docstring."""
    folders, top = media_folders(root)
    looks = [f for f in folders if re.match(r"^\d+_", f.name)]
    if not looks and not forced:
        return None
    if not folders:
        raise DataError(
            f"{what}, but {root} has no sub-folders of images",
            hint="put the images in folders named <repeats>_<name> (e.g. '10_sks dog'), or set data.layout: folder",
        )
    if top:
        raise DataError(
            f"{root} holds <repeats>_<name> folders ({looks[0].name if looks else folders[0].name}) and images at "
            f"its top ({top[0].name}{f' and {len(top) - 1} more' if len(top) > 1 else ''}), which kohya's layout "
            "leaves out",
            hint="move those images into a folder such as '1_<name>', or set data.layout: folder to read every "
            "image once",
        )
    for f in folders:
        if not re.match(r"^\d+_", f.name) and looks:
            raise DataError(
                f"{root} holds <repeats>_<name> folders ({looks[0].name}), so it reads as kohya's layout, but its "
                f"folder {f.name!r} is not named so",
                hint=_LAYOUT_HINT,
            )
    return [(f, *parse_kohya_name(f.name, f)) for f in folders]


def _relative(path: Path, base: Path | None) -> Path:
    path = Path(path).expanduser()
    return path if path.is_absolute() or base is None else Path(base) / path


def resolve_subsets(d: DataConfig) -> list[Subset]:
    """The folders ``d`` reads, in order (see the module docstring); regularisation folders last."""
    out: list[Subset] = []
    if d.subsets:
        for i, s in enumerate(d.subsets):
            name = d.subset_name(i)
            folder = _relative(s.dir, d.dir)
            if not folder.is_dir():
                raise DataError(
                    f"data.subsets[{i}] ({name}): the folder {folder} does not exist or is not a folder",
                    hint="fix its dir (image_dir in an sd-scripts dataset config, path in diffusion-pipe's), "
                    "or remove the subset",
                )
            meta = _relative(s.metadata, d.dir) if s.metadata is not None else None
            out.append(
                Subset(
                    name=name,
                    dir=folder,
                    data=d.subset_data(i),
                    repeats=s.num_repeats,
                    is_reg=s.is_reg,
                    class_tokens=s.class_tokens,
                    metadata=meta,
                    key_prefix=("reg:" if s.is_reg else "") + name + "/",
                    origin="data.subsets",
                )
            )
    elif d.dir is not None:
        layout = None if d.layout == "folder" else kohya_folders(Path(d.dir), forced=d.layout == "kohya")
        if layout is None:
            out.append(Subset(name="", dir=Path(d.dir), data=d, metadata=d.metadata))
        else:
            out += [
                Subset(
                    name=f.name,
                    dir=f,
                    data=d,
                    repeats=n,
                    class_tokens=tokens,
                    metadata=d.metadata,
                    key_prefix=f.name + "/",
                    origin="kohya layout",
                )
                for f, n, tokens in layout
            ]
    if d.reg_dir is not None:
        reg = kohya_folders(Path(d.reg_dir), True, "data.reg_dir (sd-scripts' reg_data_dir) is read in kohya's layout")
        assert reg is not None  # forced: a layout or an error
        out += [
            Subset(
                name="reg:" + f.name,
                dir=f,
                data=d,
                repeats=n,
                is_reg=True,
                class_tokens=tokens,
                key_prefix="reg:" + f.name + "/",
                origin="reg_dir",
            )
            for f, n, tokens in reg
        ]
    return out
