"""Dataset configs from other trainers -> difftrain's data section (data.subsets and what goes with it).

:func:`read_dataset_toml` reads either of two TOML files and returns the config overrides it maps to, with every
key it read but could not map and the reason, as ``difftrain convert-args`` does for command lines:

* **sd-scripts' ``--dataset_config``** (``[general]``, ``[[datasets]]``, ``[[datasets.subsets]]``; its schema is
  ``library/config_util.py``'s ``ConfigSanitizer``, documented in ``docs/config_README-en.md``). A subset-level key
  may be written in ``[general]`` or ``[[datasets]]`` and is inherited below (the lower wins, as in sd-scripts);
  dataset-level keys (resolution, the bucket keys, batch_size) apply to that dataset's subsets. Each subset becomes
  one of ``data.subsets``, its dataset's resolution and buckets carried with it. Relative paths are relative to the
  working directory, as sd-scripts reads them.
* **diffusion-pipe's dataset config** (top-level keys, ``[[directory]]`` with ``path``, ``num_repeats`` and
  overrides; ``examples/dataset.toml``). A directory trained at several ``resolutions`` becomes one subset per
  resolution (diffusion-pipe duplicates the dataset per area, and so does this); ``frame_buckets`` give the
  longest frame bucket (difftrain buckets every 4k+1 frame count up to it); ``cache_shuffle_num`` tag-shuffled
  captions are difftrain's ``caption_variants``. Captions are ``<name>.txt``, as diffusion-pipe reads them.

A key neither trainer knows is a :class:`~difftrain.errors.ConfigError` naming where it is (a typo would otherwise
be dropped silently; sd-scripts refuses it too), as are a missing folder key and a malformed repeat count. The
folders are checked when the data is read (precompute), like any data.dir.

This module reads TOML into plain dicts; the result is validated with the rest of the config (config.load). Two
ways in: ``data.dataset_config: FILE`` (``--dataset-config FILE``), which config.load reads as a layer of its own
and whose unmapped keys the CLI prints; or a caller such as ``difftrain convert-args`` calling
``read_dataset_toml(path)`` and merging ``reading.config`` into its own config (``reading.data_overrides()`` for the
data section alone) and ``reading.unmapped`` into its list of (option, reason).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# ---------------------------------------------------------------- sd-scripts' schema (config_util.ConfigSanitizer)
#: subset keys that may also be written in [general] and [[datasets]] (SUBSET_ASCENDABLE, DO_, DB_ ... ASCENDABLE)
SD_ASCENDABLE = {
    "color_aug",
    "face_crop_aug_range",
    "flip_aug",
    "num_repeats",
    "random_crop",
    "shuffle_caption",
    "keep_tokens",
    "keep_tokens_separator",
    "secondary_separator",
    "caption_separator",
    "enable_wildcard",
    "token_warmup_min",
    "token_warmup_step",
    "caption_prefix",
    "caption_suffix",
    "custom_attributes",
    "resize_interpolation",
    "caption_dropout_every_n_epochs",
    "caption_dropout_rate",
    "caption_tag_dropout_rate",
    "caption_extension",
    "class_tokens",
    "cache_info",
}
#: keys of a subset only (DB_ / FT_ / CN_SUBSET_DISTINCT_SCHEMA)
SD_SUBSET_ONLY = {"image_dir", "is_reg", "alpha_mask", "metadata_file", "conditioning_data_dir"}
#: keys of a dataset (and [general]) only (DATASET_ASCENDABLE_SCHEMA)
SD_DATASET_ONLY = {
    "batch_size",
    "bucket_no_upscale",
    "bucket_reso_steps",
    "enable_bucket",
    "max_bucket_reso",
    "min_bucket_reso",
    "validation_seed",
    "validation_split",
    "resolution",
    "network_multiplier",
}

#: sd-scripts subset key -> difftrain subset field, the value as it is (checked by the schema)
SD_SUBSET_KEYS = {
    "image_dir": "dir",
    "metadata_file": "metadata",
    "num_repeats": "num_repeats",
    "is_reg": "is_reg",
    "class_tokens": "class_tokens",
    "caption_extension": "caption_ext",
    "caption_prefix": "caption_prefix",
    "caption_suffix": "caption_suffix",
    "keep_tokens": "keep_tokens",
    "keep_tokens_separator": "keep_tokens_separator",
    "caption_separator": "caption_separator",
    "shuffle_caption": "shuffle_caption",
    "caption_dropout_rate": "caption_dropout_rate",
    "caption_tag_dropout_rate": "caption_tag_dropout_rate",
    "alpha_mask": "alpha_mask",
    "flip_aug": "flip_aug",
}
#: sd-scripts dataset key -> difftrain subset field (resolution is converted on its own)
SD_DATASET_KEYS = {
    "bucket_reso_steps": "bucket_step",
    "min_bucket_reso": "min_side",
    "max_bucket_reso": "max_side",
    "bucket_no_upscale": "no_upscale",
}

#: keys read but not mapped, and why; said only when set to something other than sd-scripts' default
SD_UNMAPPED: dict[str, tuple[Any, str]] = {
    "color_aug": (False, "difftrain caches latents once: no colour augmentation"),
    "face_crop_aug_range": (None, "difftrain caches latents once: no face-crop augmentation"),
    "secondary_separator": (None, "not available: tags are split at caption_separator only"),
    "enable_wildcard": (False, "not available: a caption file is read whole (no {a|b} wildcards or line choice)"),
    "token_warmup_min": (1, "not available: every tag is used from the first step"),
    "token_warmup_step": (0, "not available: every tag is used from the first step"),
    "custom_attributes": (None, "not read by difftrain"),
    "resize_interpolation": (None, "difftrain resizes with Lanczos when shrinking and bicubic when enlarging"),
    "caption_dropout_every_n_epochs": (0, "not available: use caption_dropout_rate"),
    "cache_info": (False, "implied: difftrain's precompute keeps image sizes and captions in its cache"),
    "conditioning_data_dir": (None, "ControlNet datasets are not trained by difftrain"),
    "validation_seed": (None, "difftrain holds out validation.loss_items items (seeded by validation.seed)"),
    "validation_split": (0.0, "difftrain holds out validation.loss_items items, a count rather than a share"),
    "network_multiplier": (1.0, "not available: every dataset trains the adapter at full strength"),
    "enable_bucket": (True, "difftrain always buckets by aspect ratio (sd-scripts without it crops to a square)"),
}

# ---------------------------------------------------------------- diffusion-pipe's keys (utils/dataset.py)
#: keys of the top level that a [[directory]] may override
DP_OVERRIDABLE = {
    "resolutions",
    "enable_ar_bucket",
    "min_ar",
    "max_ar",
    "num_ar_buckets",
    "ar_buckets",
    "size_buckets",
    "frame_buckets",
    "cache_shuffle_num",
    "cache_shuffle_delimiter",
    "skip_empty_caption",
    "shuffle_tags",
    "caption_prefix",
    "num_repeats",
    "shuffle_metadata",
    "online_captions",
}
DP_TOP_ONLY = {"directory", "subsample_ratio"}
DP_DIRECTORY_ONLY = {"path", "mask_path", "control_path", "default_mask_file"}
DP_UNMAPPED: dict[str, str] = {
    "min_ar": "difftrain's buckets are every multiple of data.bucket_step between data.min_side and data.max_side "
    "at the resolution's area: set those to bound the aspect ratios",
    "max_ar": "difftrain's buckets are every multiple of data.bucket_step between data.min_side and data.max_side "
    "at the resolution's area: set those to bound the aspect ratios",
    "num_ar_buckets": "difftrain makes every bucket of data.bucket_step's grid (set a larger step for fewer)",
    "ar_buckets": "difftrain's buckets come from data.resolution, bucket_step, min_side and max_side",
    "size_buckets": "difftrain's buckets come from data.resolution, bucket_step, min_side and max_side",
    "skip_empty_caption": "difftrain trains an image without a caption on data.caption_fallback (the empty caption)",
    "shuffle_metadata": "not needed: precompute reads the images in a fixed order",
    "online_captions": "not available: captions are the .txt files beside the media",
    "subsample_ratio": "not available: every item of a folder is trained (num_repeats weights folders)",
    "mask_path": "masks from another folder are data.mask_dir (one for the whole dataset): set it yourself",
    "control_path": "edit / control datasets are not read from a dataset config",
    "default_mask_file": "not available: an image without a mask is learned everywhere",
}


@dataclass
class DatasetConfigReading:
    """What a dataset TOML maps to: config overrides (nested dicts, as a YAML config would hold them), and every
    key that was read but not mapped, with the reason."""

    path: Path
    kind: str  # "sd-scripts" or "diffusion-pipe"
    config: dict[str, Any] = field(default_factory=dict)
    unmapped: list[tuple[str, str]] = field(default_factory=list)

    def set(self, dotted: str, value: Any) -> None:
        d = self.config
        *head, last = dotted.split(".")
        for k in head:
            d = d.setdefault(k, {})
        d[last] = value

    def data_overrides(self) -> dict[str, Any]:
        """The data section's part of :attr:`config`."""
        return dict(self.config.get("data", {}))


def _load(path: Path) -> dict[str, Any]:
    import tomllib

    if not path.is_file():
        raise ConfigError(
            f"The dataset config {path} does not exist.", hint="Give the TOML file's path (--dataset-config FILE)."
        )
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(
            f"The dataset config {path} is not valid TOML: {e}",
            hint="Fix the line it names (TOML strings are quoted; Windows paths in single quotes: 'C:\\images').",
        ) from None


def read_dataset_toml(path: Path | str, base: Path | None = None) -> DatasetConfigReading:
    """Read sd-scripts' or diffusion-pipe's dataset TOML at ``path`` into difftrain config overrides (see the module
    docstring). ``base``: what relative folders are relative to (default: the working directory, as both trainers
    read them). :class:`ConfigError` for an unreadable file, a key neither trainer knows (naming where), a subset
    without its folder and a malformed repeat count; the folders themselves are checked when the data is read."""
    path = Path(path)
    raw = _load(path)
    base = Path(base) if base is not None else Path.cwd()
    if "datasets" in raw or "general" in raw:
        return _sd_scripts(raw, path, base)
    if "directory" in raw:
        return _diffusion_pipe(raw, path, base)
    raise ConfigError(
        f"The dataset config {path} has neither [[datasets]] (sd-scripts) nor [[directory]] (diffusion-pipe) tables.",
        hint="Give sd-scripts' --dataset_config file or diffusion-pipe's dataset TOML.",
    )


def _problem(path: Path, where: str, what: str, hint: str) -> ConfigError:
    return ConfigError(f"The dataset config {path} has a problem at {where}: {what}", hint=hint)


def _folder(value: Any, base: Path, path: Path, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _problem(path, where, f"{value!r} is not a folder path", "Write the folder as a quoted string.")
    p = Path(os.path.expanduser(value))
    return str(p if p.is_absolute() else base / p)


def _repeats(value: Any, path: Path, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _problem(
            path,
            where,
            f"num_repeats is {value!r}: it must be a whole number of 1 or more",
            "Write e.g. num_repeats = 10 (no quotes).",
        )
    return value


def _side(value: Any, step: int, path: Path, where: str) -> int:
    """sd-scripts' resolution (``512`` or ``[w, h]``) as the side of the square of its area, on the bucket grid."""
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        area = value[0] * value[1]
    elif isinstance(value, int) and not isinstance(value, bool):
        area = value * value
    else:
        raise _problem(path, where, f"resolution {value!r} is not a number or [width, height]", "Write e.g. 512.")
    side = math.isqrt(max(area, 1))
    return max(side - side % step, step)


# ---------------------------------------------------------------- sd-scripts
def _sd_check_keys(table: dict[str, Any], allowed: set[str], path: Path, where: str) -> None:
    for key in table:
        if key in allowed:
            continue
        if key in SD_SUBSET_ONLY:
            what = f"{key} belongs in a [[datasets.subsets]] table"
        elif key in SD_DATASET_ONLY:
            what = f"{key} is a dataset's option: write it in [[datasets]] or [general], not in a subset"
        else:
            what = f"unknown key {key!r} (neither sd-scripts nor difftrain reads it)"
        raise _problem(
            path, f"{where}.{key}", what, "Fix or remove it (sd-scripts' docs/config_README-en.md lists the keys)."
        )


def _sd_scripts(raw: dict[str, Any], path: Path, base: Path) -> DatasetConfigReading:
    out = DatasetConfigReading(path, "sd-scripts")
    unknown_top = sorted(set(raw) - {"general", "datasets"})
    if unknown_top:
        raise _problem(
            path,
            unknown_top[0],
            "unknown table or key",
            "An sd-scripts dataset config holds [general] and [[datasets]] only.",
        )
    general = raw.get("general", {})
    datasets = raw.get("datasets", [])
    if (
        not isinstance(general, dict)
        or not isinstance(datasets, list)
        or not all(isinstance(d, dict) for d in datasets)
    ):
        raise _problem(
            path,
            "the top",
            "[general] must be a table and [[datasets]] an array of tables",
            "See sd-scripts' docs/config_README-en.md.",
        )
    if not datasets:
        raise _problem(path, "the top", "no [[datasets]]", "Add a [[datasets]] table with [[datasets.subsets]] in it.")
    _sd_check_keys(general, SD_ASCENDABLE | SD_DATASET_ONLY, path, "[general]")
    subsets: list[dict[str, Any]] = []
    said: set[tuple[str, str]] = set()
    batch_sizes: list[tuple[str, int]] = []
    random_crop: set[bool] = set()
    for i, ds in enumerate(datasets):
        where_ds = f"datasets[{i}]"
        _sd_check_keys(ds, SD_ASCENDABLE | SD_DATASET_ONLY | {"subsets"}, path, where_ds)
        level = {**general, **{k: v for k, v in ds.items() if k != "subsets"}}
        if "batch_size" in level:
            batch_sizes.append((where_ds, level["batch_size"]))
        seen_dirs: set[str] = set()
        subs = ds.get("subsets", [])
        if not isinstance(subs, list) or not subs:
            raise _problem(path, where_ds, "no [[datasets.subsets]]", "Add a [[datasets.subsets]] with its image_dir.")
        for j, sub in enumerate(subs):
            where = f"{where_ds}.subsets[{j}]"
            if not isinstance(sub, dict):
                raise _problem(path, where, "not a table", "Write it as [[datasets.subsets]].")
            _sd_check_keys(sub, SD_ASCENDABLE | SD_SUBSET_ONLY, path, where)
            merged = {**level, **sub}
            if "image_dir" not in merged and "metadata_file" not in merged:
                raise _problem(path, where, "no image_dir", "Give the subset's folder: image_dir = '/path/to/images'.")
            if "image_dir" not in merged:
                raise _problem(
                    path,
                    where,
                    "a metadata_file without image_dir",
                    "Add image_dir (difftrain reads the images of one folder per subset).",
                )
            if "conditioning_data_dir" in merged:
                raise _problem(
                    path,
                    where,
                    "a ControlNet subset (conditioning_data_dir)",
                    "difftrain does not train ControlNets: remove this dataset.",
                )
            folder = _folder(merged["image_dir"], base, path, f"{where}.image_dir")
            ident = folder + "|" + str(merged.get("metadata_file", ""))
            if ident in seen_dirs:  # sd-scripts: a duplicate subset of a dataset is ignored
                out.unmapped.append(
                    (
                        f"{where}.image_dir={merged['image_dir']}",
                        "the same folder twice in one dataset: ignored, as sd-scripts ignores it",
                    )
                )
                continue
            seen_dirs.add(ident)
            subsets.append(_sd_subset(merged, folder, base, path, where))
            random_crop.add(bool(merged.get("random_crop", False)))
            for key, value in merged.items():
                if key in SD_UNMAPPED and value != SD_UNMAPPED[key][0] and (key, str(value)) not in said:
                    said.add((key, str(value)))
                    out.unmapped.append((f"{key}={value!r}", SD_UNMAPPED[key][1]))
            if "num_repeats" not in sub and Path(folder).name[:1].isdigit() and "_" in Path(folder).name:
                said.add(("layout", folder))
                out.unmapped.append(
                    (
                        f"{where}.image_dir={merged['image_dir']}",
                        "a dataset config does not read repeats or tokens from a "
                        "folder's name (as sd-scripts): set num_repeats and class_tokens",
                    )
                )
    out.set("data.subsets", subsets)
    if batch_sizes:
        first = batch_sizes[0][1]
        out.set("train.batch_size", first)
        if len({b for _, b in batch_sizes}) > 1:
            out.unmapped.append(
                (
                    ", ".join(f"{w}.batch_size={b}" for w, b in batch_sizes),
                    f"difftrain trains one batch size: train.batch_size {first}, the first dataset's",
                )
            )
    if len(random_crop) > 1:
        out.unmapped.append(("random_crop", "difftrain crops every subset alike: set data.random_crop for all"))
    elif random_crop == {True}:
        out.set("data.random_crop", True)
    return out


def _sd_subset(merged: dict[str, Any], folder: str, base: Path, path: Path, where: str) -> dict[str, Any]:
    """One [[datasets.subsets]] (its dataset's and [general]'s keys merged in) as a data.subsets entry."""
    sub: dict[str, Any] = {"dir": folder}
    for key, target in SD_SUBSET_KEYS.items():
        if key not in merged or key == "image_dir":
            continue
        value = merged[key]
        if key == "metadata_file":
            value = _folder(value, base, path, f"{where}.metadata_file")
        elif key == "num_repeats":
            value = _repeats(value, path, f"{where}.num_repeats")
        elif key == "caption_extension" and isinstance(value, str) and not value.startswith("."):
            value = "." + value  # sd-scripts accepts 'txt' for '.txt'
        sub[target] = value
    for key, target in SD_DATASET_KEYS.items():
        if key in merged:
            sub[target] = merged[key]
    if "resolution" in merged:
        sub["resolution"] = _side(
            merged["resolution"], int(merged.get("bucket_reso_steps", 64)), path, f"{where}.resolution"
        )
    return sub


# ---------------------------------------------------------------- diffusion-pipe
def _diffusion_pipe(raw: dict[str, Any], path: Path, base: Path) -> DatasetConfigReading:
    out = DatasetConfigReading(path, "diffusion-pipe")
    for key in raw:
        if key not in DP_OVERRIDABLE | DP_TOP_ONLY:
            raise _problem(
                path,
                key,
                f"unknown key {key!r} (diffusion-pipe's dataset config has no such key)",
                "Fix or remove it (diffusion-pipe's examples/dataset.toml lists the keys).",
            )
    dirs = raw["directory"]
    if not isinstance(dirs, list) or not dirs or not all(isinstance(d, dict) for d in dirs):
        raise _problem(
            path,
            "directory",
            "[[directory]] must be one or more tables",
            "Write each folder as [[directory]] with its path.",
        )
    top = {k: v for k, v in raw.items() if k != "directory"}
    said: set[str] = set()
    subsets: list[dict[str, Any]] = []
    shuffles: set[int] = set()
    for i, d in enumerate(dirs):
        where = f"directory[{i}]"
        for key in d:
            if key not in DP_OVERRIDABLE | DP_DIRECTORY_ONLY:
                raise _problem(
                    path,
                    f"{where}.{key}",
                    f"unknown key {key!r}",
                    "Fix or remove it (diffusion-pipe's examples/dataset.toml lists the keys).",
                )
        if "path" not in d:
            raise _problem(path, where, "no path", "Give the folder: path = '/path/to/images'.")
        merged = {**top, **d}
        folder = _folder(d["path"], base, path, f"{where}.path")
        sub: dict[str, Any] = {"dir": folder, "caption_ext": ".txt"}
        if "num_repeats" in merged:
            sub["num_repeats"] = _repeats(merged["num_repeats"], path, f"{where}.num_repeats")
        if "frame_buckets" in merged:
            sub["frames"] = _frames(merged["frame_buckets"], path, where, out, said)
        shuffle = merged.get("cache_shuffle_num", 0)
        if shuffle or merged.get("shuffle_tags"):
            sub["shuffle_caption"] = True
            shuffles.add(int(shuffle) if shuffle else 0)
            delimiter = str(merged.get("cache_shuffle_delimiter", ", ")).strip() or ","
            sub["caption_separator"] = delimiter
        if isinstance(merged.get("caption_prefix"), str) and merged["caption_prefix"].strip():
            sub["caption_prefix"] = merged["caption_prefix"].rstrip()  # difftrain puts the space between
        if merged.get("enable_ar_bucket") is False and "enable_ar_bucket" not in said:
            said.add("enable_ar_bucket")
            out.unmapped.append(("enable_ar_bucket=false", "difftrain always buckets by aspect ratio"))
        for key, why in DP_UNMAPPED.items():
            if key in merged and key not in said:
                said.add(key)
                out.unmapped.append((f"{key}={merged[key]!r}", why))
        resolutions = merged.get("resolutions")
        if resolutions is None:
            subsets.append(sub)
            continue
        if not isinstance(resolutions, list) or not resolutions:
            raise _problem(
                path, f"{where}.resolutions", f"{resolutions!r} is not a list", "Write e.g. resolutions = [512]."
            )
        sides = sorted({_side(r, 16, path, f"{where}.resolutions") for r in resolutions})
        name = Path(folder).name or folder
        for side in sides:  # diffusion-pipe trains the folder once per area: one subset each
            subsets.append({**sub, "resolution": side, **({"name": f"{name}@{side}"} if len(sides) > 1 else {})})
        if len(sides) > 1 and "resolutions" not in said:
            said.add("resolutions")
            out.unmapped.append(
                (
                    f"resolutions={resolutions!r}",
                    f"mapped: each folder is one subset per area ({', '.join(map(str, sides))})",
                )
            )
    if shuffles - {0}:
        out.set("data.caption_variants", max(shuffles))
    out.set("data.subsets", subsets)
    return out


def _frames(buckets: Any, path: Path, where: str, out: DatasetConfigReading, said: set[str]) -> int:
    if not isinstance(buckets, list) or not buckets or not all(isinstance(b, int) and b >= 1 for b in buckets):
        raise _problem(
            path,
            f"{where}.frame_buckets",
            f"{buckets!r} is not a list of frame counts",
            "Write e.g. frame_buckets = [1, 33].",
        )
    longest = max(buckets)
    frames = longest - (longest - 1) % 4  # the longest 4k+1 not above it
    if "frame_buckets" not in said:
        said.add("frame_buckets")
        out.unmapped.append(
            (
                f"frame_buckets={buckets!r}",
                f"mapped to data.frames {frames}: difftrain buckets every 4k+1 frame count up to it (the video VAE "
                "compresses time 4x after the first frame)",
            )
        )
    return frames
