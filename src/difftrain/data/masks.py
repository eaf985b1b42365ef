"""Masked loss: which pixels of an item are learned, and how much, read from a mask and cached at latent resolution.

A mask weights the loss of each latent pixel (sd-scripts' masked loss, OneTrainer's masked training): white (1) is
learned, black (0) is not, grey in between. It comes from

- the image's own alpha channel (``data.alpha_mask``, sd-scripts' ``--alpha_mask``): transparent is not learned; an
  image without an alpha channel is learned everywhere, as sd-scripts does;
- a mask file with the image's name in ``data.mask_dir`` (sd-scripts' ``conditioning_data_dir``; the image's
  sub-folder mirrored there, or, for an image in a sub-folder, its name alone at the top when no other image of
  the dataset has that name: a flat mask folder for kohya's ``10_name`` folders), optionally with a
  suffix after the stem (``data.mask_suffix``; OneTrainer's ``-masklabel``, whose masks lie beside the images when
  no folder is set). A greyscale mask is its value; of a colour mask the red channel is read, as sd-scripts reads it.
  A mask of another size than its image is resized to it (the same aspect ratio within a pixel; another is an error
  naming both files). An image without a mask file is learned everywhere and listed by precompute (sd-scripts
  refuses such a dataset; a folder with no mask for any image is refused here too).

The mask is fitted to the image's bucket exactly as the image is (the same resize to cover, the same crop, from the
latent entry's crop offsets) and area-averaged to the latent's size (sd-scripts' ``apply_masked_loss`` interpolates
with ``mode="area"``), for a video also over the frames each latent frame stands for. A video takes one mask image
for all its frames, a mask folder ``<mask_dir>/<clip name>/`` of one image per frame of the clip (sorted by name), or
a mask video ``<mask_dir>/<clip name>.mp4`` (any of the clips' video formats) of as many frames as the clip (its red
channel read, as of a colour mask image).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageChops

from ..errors import DataError
from .buckets import Bucket, resize_to_cover
from .paths import IMAGE_EXTS, check_inside

MaskKind = Literal["alpha", "file", "frames", "video"]

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_MASK_HINT = "fix or replace the mask, or remove it (the image is then learned everywhere)"


@dataclass(frozen=True)
class MaskSource:
    """Where one item's mask is read: its image's alpha channel, a mask file, or a folder of per-frame masks."""

    kind: MaskKind
    path: Path  # the image (alpha), the mask file, the folder of frame masks, or the mask video

    def files(self) -> list[Path]:
        """The mask images, in frame order (one but for a folder of frame masks)."""
        if self.kind != "frames":
            return [self.path]
        return sorted(p for p in self.path.iterdir() if p.suffix.lower() in IMAGE_EXTS and not p.name.startswith("."))


@dataclass(frozen=True)
class MaskSpec:
    """The masks a dataset (or, later, one subset of it) is trained with: the data config's alpha_mask, mask_dir and
    mask_suffix."""

    alpha: bool = False
    folder: Path | None = None
    suffix: str = ""

    @classmethod
    def from_config(cls, d: Any) -> MaskSpec:
        """From a ``DataConfig`` (or anything with its alpha_mask, mask_dir and mask_suffix)."""
        folder = getattr(d, "mask_dir", None)
        return cls(
            bool(getattr(d, "alpha_mask", False)), Path(folder) if folder else None, getattr(d, "mask_suffix", "")
        )

    @property
    def enabled(self) -> bool:
        return self.alpha or self.folder is not None or bool(self.suffix)

    @property
    def files(self) -> bool:
        """Masks come from files (a folder, or beside the images with a suffix), not from the alpha channel."""
        return self.folder is not None or bool(self.suffix)

    def record(self) -> dict[str, Any] | None:
        """What index.json records of the masks its entries were made from (training compares it)."""
        if not self.enabled:
            return None
        if self.alpha:
            return {"source": "alpha"}
        return {"source": "files", "dir": str(self.folder) if self.folder else None, "suffix": self.suffix}

    def is_mask_file(self, path: Path) -> bool:
        """Whether ``path`` (found by the data folder's scan) is one of the masks, not a training image: a name
        ending in the suffix, with masks beside the images."""
        return bool(self.suffix) and self.folder is None and Path(path).stem.endswith(self.suffix)

    def find(self, key: str, image: Path, *, video: bool = False, root: Path | None = None) -> MaskSource | None:
        """The mask of the item ``key`` (its path in the data folder without extension) whose file is ``image``; None
        when it has none. ``root``: links must not lead outside it (the mask folder, or the data folder)."""
        if self.alpha:
            return MaskSource("alpha", Path(image))
        base = (self.folder / key) if self.folder is not None else Path(image).with_suffix("")
        name = base.name + self.suffix
        if video and self.folder is not None and (base.parent / name).is_dir():
            return _checked(MaskSource("frames", base.parent / name), self.folder, root)
        if video and self.folder is not None:
            from .video import VIDEO_EXTS

            for ext in VIDEO_EXTS:
                for cand in (base.parent / (name + ext), base.parent / (name + ext.upper())):
                    if cand.is_file():
                        return _checked(MaskSource("video", cand), self.folder, root)
        for ext in IMAGE_EXTS:
            for cand in (base.parent / (name + ext), base.parent / (name + ext.upper())):
                if cand.is_file():
                    return _checked(MaskSource("file", cand), self.folder, root)
        return None


def masks_wanted(d: Any) -> dict[str, Any] | None:
    """What the masks of a data config are (:meth:`MaskSpec.record` of the section, or of the first subset that
    sets its own), None when no item is trained with masks: what training reads the cache's masks by."""
    specs = [MaskSpec.from_config(d)]
    for i in range(len(getattr(d, "subsets", []) or [])):
        specs.append(MaskSpec.from_config(d.subset_data(i)))
    return next((s.record() for s in specs if s.enabled), None)


def _checked(source: MaskSource, folder: Path | None, root: Path | None) -> MaskSource:
    if root is not None:
        check_inside(source.path, folder if folder is not None else root)
    return source


# ----------------------------------------------------------------- reading
def _upright(image: Image.Image) -> Image.Image:
    from .sources import _TRANSPOSE, _exif_orientation  # the images' own orientation rule

    orientation = _exif_orientation(image)
    image.load()
    return image.transpose(_TRANSPOSE[orientation]) if orientation in _TRANSPOSE else image


def has_alpha(image: Image.Image) -> bool:
    palette_alpha = image.mode == "P" and image.palette is not None and image.palette.mode == "RGBA"
    return image.mode in _ALPHA_MODES or palette_alpha or image.info.get("transparency") is not None


def alpha_present(path: Path) -> bool:
    """Whether an image file has an alpha channel (its header read; False for what Pillow cannot open, a video)."""
    try:
        with Image.open(path) as image:
            return has_alpha(image)
    except Exception:  # noqa: BLE001 - a video or an unreadable file: no alpha to read (the scan says why)
        return False


def read_mask(path: Path, kind: MaskKind) -> tuple[Image.Image | None, bool]:
    """The mask as an upright 8-bit greyscale image (None: an alpha mask of an image without alpha, learned
    everywhere), and whether a mask file was in colour (its red channel taken). :class:`DataError` naming the file
    when it cannot be read."""
    try:
        with Image.open(path) as opened:
            image = _upright(opened)
            if kind == "alpha":
                return (image.convert("RGBA").getchannel("A") if has_alpha(image) else None), False
            if image.mode in ("1", "L"):
                return image.convert("L"), False
            if image.mode == "I" or image.mode.startswith("I;16") or image.mode == "F":
                from .sources import to_rgb  # 16-bit and float greyscale scaled to 8 bits as the images are

                return to_rgb(image).getchannel("R"), False
            r, g, b = image.convert("RGB").split()  # as sd-scripts: its own alpha dropped, the red channel read
            colour = (
                ImageChops.difference(r, g).getbbox() is not None or ImageChops.difference(r, b).getbbox() is not None
            )
            return r, colour
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"cannot read the mask {path}: {exc}", hint=_MASK_HINT) from exc


def mask_size(path: Path) -> tuple[int, int]:
    """The upright (width, height) of a mask file from its header."""
    from .sources import read_image_size

    try:
        return read_image_size(path)
    except Exception as exc:  # Pillow raises many types for bad files
        raise DataError(f"cannot read the mask {path}: {exc}", hint=_MASK_HINT) from exc


def same_aspect(size: tuple[int, int], other: tuple[int, int]) -> bool:
    """Whether two sizes have one aspect ratio, within a pixel's rounding (a mask drawn at half size is one)."""
    (w, h), (mw, mh) = size, other
    return abs(mw * h - mh * w) <= max(w, h, mw, mh)


def mask_video_frames(path: Path) -> tuple[tuple[int, int], int]:
    """A mask video's upright (width, height) and frame count (its header read, as the clips' are)."""
    from .video import probe_video

    try:
        width, height, frames, _ = probe_video(path)
    except Exception as exc:  # PyAV and the probe raise many types for bad files
        raise DataError(f"cannot read the mask video {path}: {exc}", hint=_MASK_HINT) from exc
    return (width, height), frames


def check_mask_size(source: MaskSource, image: Path, size: tuple[int, int], frames: int = 1) -> None:
    """:class:`DataError` naming both files when a mask's aspect ratio is not its image's (``size``: the image's
    upright width and height), or a mask video's or mask folder's frame count is not its clip's (``frames``); a mask
    of the same ratio at another size is resized to the image."""
    if source.kind == "alpha":
        return
    if source.kind == "video":
        ms, n = mask_video_frames(source.path)
        if not same_aspect(size, ms):
            raise DataError(
                f"the mask video {source.path} is {ms[0]}x{ms[1]}, its clip {image} is {size[0]}x{size[1]}: another "
                "aspect ratio, so which pixels it means is unclear",
                hint="make the mask video at the clip's size (or the same shape at another size), or remove it",
            )
        if n != frames:
            raise DataError(
                f"the mask video {source.path} has {n} frames, its clip {image} has {frames}",
                hint="give the mask video one frame per frame of the clip, or use one mask image for all frames",
            )
        return
    files = source.files()
    if not files:
        raise DataError(f"the mask folder {source.path} of {image} holds no images", hint=_MASK_HINT)
    if source.kind == "frames" and len(files) != frames:
        raise DataError(
            f"the mask folder {source.path} holds {len(files)} images, its clip {image} has {frames} frames",
            hint="give one mask image per frame of the clip (sorted by name), or one mask image for all frames",
        )
    for f in files:
        ms = mask_size(f)
        if not same_aspect(size, ms):
            raise DataError(
                f"the mask {f} is {ms[0]}x{ms[1]}, its image {image} is {size[0]}x{size[1]}: another aspect ratio, "
                "so which pixels it means is unclear",
                hint="draw the mask at the image's size (or the same shape at another size: it is resized), "
                "or remove it",
            )


# ----------------------------------------------------------------- fitting
def _resize(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    if image.size == size:
        return image
    shrinking = size[0] < image.width or size[1] < image.height
    return image.resize(size, Image.Resampling.LANCZOS if shrinking else Image.Resampling.BICUBIC)


def fit_mask(mask: Image.Image, image_size: tuple[int, int], bucket: Bucket, crop: tuple[int, int]) -> torch.Tensor:
    """``mask`` fitted to ``bucket`` as its image was (:func:`~difftrain.data.buckets.fit_to_bucket`: resized to
    cover with the same filter, cropped at the image's ``crop`` = (top, left)): ``[height, width]`` in [0, 1]. A mask
    of another size is first resized to the image's ``image_size`` = (width, height)."""
    mask = _resize(mask, image_size)
    mask = _resize(mask, resize_to_cover(image_size[0], image_size[1], bucket))
    (bw, bh), (top, left) = bucket, crop
    if mask.size != (bw, bh):
        mask = mask.crop((left, top, left + bw, top + bh))
    return torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)


def to_latent(pixels: torch.Tensor, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """A mask at pixel resolution (``[H, W]``, or ``[F, H, W]`` for a clip's frames) area-averaged to a latent of
    ``latent_shape`` (``[C, h, w]`` or ``[C, f, h, w]``): ``[1, h, w]`` or ``[1, f, h, w]`` (``f`` is 1 for one mask
    of all frames), broadcasting over the channels. A clip's latent frame 0 stands for frame 0 and each further one
    for the next (F - 1) / (f - 1) frames (the video VAEs' causal compression in time), so each is their mean."""
    h, w = latent_shape[-2:]
    if pixels.ndim == 2:
        pixels = pixels[None]
    spatial = F.interpolate(pixels[:, None].float(), size=(h, w), mode="area")[:, 0]  # [F, h, w]
    if len(latent_shape) == 3:
        return spatial[:1]
    f = latent_shape[1]
    if spatial.shape[0] == 1 or spatial.shape[0] == f:
        return spatial[None]
    n = spatial.shape[0]
    if f < 2 or (n - 1) % (f - 1):
        raise ValueError(f"{n} mask frames do not map onto {f} latent frames")
    k = (n - 1) // (f - 1)
    rest = spatial[1:].reshape(f - 1, k, h, w).mean(dim=1)
    return torch.cat([spatial[:1], rest])[None]


def read_mask_video(path: Path, indices: list[int], frames: int) -> list[Image.Image]:
    """The frames at ``indices`` of a mask video (of ``frames`` frames), each its red channel as an 8-bit image."""
    from .video import VideoRecord, _decode_frames

    record = VideoRecord(path.stem, path, "", 1, 1, frames, 0.0, False)
    distinct = sorted(set(indices))
    decoded = dict(zip(distinct, _decode_frames(record, distinct)))  # DataError naming the file
    return [Image.fromarray(decoded[i][..., 0].copy(), "L") for i in indices]
