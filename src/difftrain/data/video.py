"""Video training data for CogVideoX: scanning clips, frame and size buckets, frame sampling, decoding.

Layouts (:func:`scan_videos`, auto-detected):

* **cogvideox-factory's**: ``prompt.txt`` and ``videos.txt`` in the data folder, line ``N`` of one
  describing line ``N`` of the other; video paths are relative to the data folder. A path that leads
  outside it (absolute, ``..``, or a link) is a :class:`DataError` naming the line, unless
  ``allow_outside`` (``data.allow_outside_paths``): then an absolute path stays absolute, as
  ``Path.joinpath`` does in cogvideox-factory. Blank lines at the end of either
  file are ignored. Unlike cogvideox-factory, blank lines elsewhere are *not* dropped: line numbers
  are kept, so a blank prompt line is an empty caption and a blank video line is a skipped entry
  (dropping blanks in one file only would silently pair every later prompt with the wrong clip).
* **a folder of clips**: every video (:data:`VIDEO_EXTS`) and image (:data:`CLIP_IMAGE_EXTS`) under
  the folder, with its caption in the file beside it: ``<stem><caption_ext>``, then ``<stem>.txt``,
  then ``<stem>.caption`` (the first one that exists and is not empty; none gives ``""``). Images
  are single-frame clips.

Frame counts. ``width``, ``height`` and ``fps`` come from the stream headers, and ``frames`` from the
container's frame count (``stream.frames``: the sample table of MP4/MOV, the header of AVI). Matroska
and WebM store no count (``stream.frames == 0``): there the packets of the video stream are counted
by demuxing, which reads the file but decodes nothing (one packet is one frame for the codecs used in
practice; VP9 packs its hidden frames into superframes). Every clip's first frame is decoded once
while scanning, to prove the stream decodes and to read its display rotation. A header that
over-counts (MP4 edit lists that drop leading frames, VP8 alt-ref packets) is caught when
:func:`load_clip` runs out of frames: it raises :class:`DataError` naming the file. Pass
``exact_frames=True`` to count by decoding every frame instead (slow, exact).

Display rotation (phone videos store landscape pixels plus a rotation matrix) is applied, as EXIF
orientation is for images: a record's size is the upright size and :func:`load_clip` returns upright
frames. Flips in the display matrix and non-square pixels (sample aspect ratio) are not applied.

Frame buckets (:func:`frame_buckets`, :func:`choose_frames`): CogVideoX's VAE keeps the first frame
and compresses the rest 4x in time, so a clip has ``4k + 1`` frames: ``[1, 5, 9, ..., max_frames]``.
A video gets the largest bucket ``<= `` its frame count, never the 1-frame bucket (the smallest for a
video is 5): a single frame is encoded as a still image and would train the clip as a photo; extract
frames as images if that is what you want. An image gets 1. A video shorter than its smallest usable
bucket is skipped by :func:`scan_videos`.

Size buckets (:func:`video_size_buckets`, :func:`choose_video_bucket`): the same lists and the same
nearest-aspect-ratio rule as images (:mod:`difftrain.data.buckets`), but sides are multiples of 16:
the VAE downsamples 8x and the transformer patchifies the latents 2x2, so a side that is not a
multiple of 8 * 2 = 16 pixels leaves a partial patch. A fixed list such as CogVideoX's own
``[(720, 480)]`` works too.

Sampling (:func:`sample_frame_indices`): ``uniform`` spreads the frames evenly over the whole clip,
index ``i`` being ``floor(i * (n - 1) / (F - 1) + 1/2)`` (nearest, halves up) for ``F`` frames out of
``n``, so the first and last frames are always taken; ``first`` takes ``F`` consecutive frames from
frame 0, or from a random start when a ``random.Random`` is given.

Fitting (:func:`load_clip`): every frame is resized to cover the bucket and centre-cropped (or
randomly cropped, the same crop for every frame) by :func:`difftrain.data.buckets.fit_to_bucket`,
the image rule, and the clip is returned as ``[3, F, H, W]`` float in ``[-1, 1]``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from ..errors import BackendUnavailable, DataError
from .buckets import Bucket, fit_to_bucket, make_buckets, nearest_bucket
from .paths import OUTSIDE_HINT, check_inside, is_inside, normalize_ext, read_text_file
from .sources import load_rgb, read_image_size, record_key

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv", ".avi")
CLIP_IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp")
"""Images accepted as single-frame clips."""
MIN_VIDEO_FRAMES = 5
"""The smallest frame bucket a video may get (1 is for images)."""
SIZE_MULTIPLE = 16
"""Video bucket sides are multiples of this: VAE 8x spatial downsampling times the 2x2 patch."""
PROMPT_FILE, VIDEOS_FILE = "prompt.txt", "videos.txt"

Layout = Literal["auto", "factory", "folder"]
SampleMode = Literal["uniform", "first"]


@dataclass(frozen=True)
class VideoRecord:
    """One training clip (a video, or an image as a one-frame clip)."""

    key: str
    """Path relative to the data folder, without extension, '/'-separated (for a ``videos.txt`` line
    outside the folder: the line as written, without extension)."""
    path: Path
    caption: str
    width: int
    """Upright width (display rotation applied), from the stream header."""
    height: int
    frames: int
    """Frame count (see the module docstring for how it is read); 1 for an image."""
    fps: float
    """Average frame rate from the header; 0.0 for an image or when the container gives none."""
    is_image: bool
    subset: str = ""
    """The subset it was read from (:mod:`.subsets`; "" for data.dir read as one folder)."""


# ----------------------------------------------------------------- PyAV
# PyAV: maintained bindings to FFmpeg's own libraries, so every container and codec FFmpeg reads
# works, frames come out decoded in presentation order with their timestamps and side data, and
# packets can be counted without decoding. torchvision's video reader is deprecated (and its
# ``read_video`` decodes the whole clip into memory); decord is unmaintained. We decode
# sequentially and count frames, rather than seek by timestamp, because keyframe seeking is not
# frame-exact across containers (variable frame rate, edit lists, files without an index).
def require_pyav(what: str = "reading videos") -> Any:
    """PyAV, or a refusal naming ``what`` needs it and how to install it."""
    try:
        import av
    except ImportError as exc:
        raise BackendUnavailable(
            f"{what} needs PyAV, which is not installed",
            hint="pip install 'difftrain[video]'  (or: pip install av)",
        ) from exc
    return av


def _quarter_turns(rotation: float | None) -> int:
    """Counter-clockwise quarter turns that make a frame upright, from FFmpeg's display rotation.

    ``VideoFrame.rotation`` is ``av_display_rotation_get``: the angle by which the display matrix
    rotates the frame counter-clockwise (a portrait phone clip reads -90). Angles that are not a
    multiple of 90 are rounded to the nearest quarter turn.
    """
    if rotation is None or (isinstance(rotation, float) and math.isnan(rotation)):
        return 0
    return round(rotation / 90) % 4


def _rgb_frame(frame: Any, reformatter: Any) -> np.ndarray:
    """A decoded ``av.VideoFrame`` as an upright ``[H, W, 3]`` uint8 RGB array.

    ``reformatter``: an ``av.video.reformatter.VideoReformatter`` made by this process for this clip, used with one
    thread. Why not ``frame.to_ndarray(format="rgb24")``: PyAV (18) converts through one reformatter it keeps for the
    whole process, whose FFmpeg scaler runs a pool of slice threads. Where a process converted frames before it forked
    precompute's decoding workers (a mask video read, a clip decoded earlier in the same process: the test suite's
    workers do), the fork copies that scaler but not its threads, and a worker's first conversion waits for them
    forever (the video tests hung so, 2026-12-08). A scaler made for each clip in the worker has no such past; one
    thread keeps N workers from starting N pools of as many threads as cores."""
    array = reformatter.reformat(frame, format="rgb24", threads=1).to_ndarray()
    turns = _quarter_turns(getattr(frame, "rotation", 0))
    return np.ascontiguousarray(np.rot90(array, turns)) if turns else array


def _rate(stream: Any) -> float:
    """The header's average frame rate, else FFmpeg's guess, else the base rate; 0.0 if none."""
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate:
            return float(rate)
    return 0.0


def _count_packets(container: Any, stream: Any) -> int:
    """Video packets with data (the demuxer's end-of-stream flush packet has none), not decoded."""
    return sum(1 for p in container.demux(stream) if p.size > 0 and not p.is_discard)


def probe_video(path: Path, *, exact_frames: bool = False) -> tuple[int, int, int, float]:
    """``(width, height, frames, fps)`` of a video, upright; the first frame is decoded, no more.

    ``frames`` is ``stream.frames`` when the container stores it, otherwise the count of demuxed
    packets; with ``exact_frames`` every frame is decoded and counted. Raises ``ValueError`` when
    there is no video stream or no frame decodes, and what PyAV raises for an unreadable file.
    """
    av = require_pyav()
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        decoding = container.decode(stream)
        first = next(decoding, None)
        decoding.close()  # inside the with: the generator must not outlive its container
        if first is None:
            raise ValueError("the video stream has no decodable frame")
        # the header's size (the first frame's when the header has none), turned upright
        width = stream.codec_context.width or first.width
        height = stream.codec_context.height or first.height
        if _quarter_turns(first.rotation) % 2:
            width, height = height, width
        frames = int(stream.frames or 0)
        duration_s = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else None
        if duration_s is None and container.duration:
            duration_s = container.duration / av.time_base
        rate = _rate(stream)  # read now: a stream must not be touched after its container closes
    if width <= 0 or height <= 0:
        raise ValueError(f"the stream gives an empty size {width}x{height}")
    if exact_frames or frames <= 0:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            if exact_frames:
                stream.thread_type = "AUTO"
                frames = sum(1 for _ in container.decode(stream))
            else:
                frames = _count_packets(container, stream)
    fps = rate if rate else (frames / duration_s if duration_s else 0.0)
    return width, height, frames, fps


def _unreadable_reason(path: Path, exc: BaseException) -> str:
    try:
        if path.stat().st_size == 0:
            return "empty file (0 bytes)"
    except OSError as stat_exc:
        return f"cannot read file: {stat_exc.strerror or stat_exc}"
    if isinstance(exc, ValueError) and not type(exc).__module__.startswith("av"):
        return str(exc)  # our own: no video stream, no decodable frame, empty size
    return f"not a readable video: {exc}"


# ----------------------------------------------------------------- frame buckets
def _check_frame_bucket(value: int, what: str = "frame bucket") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value % 4 != 1:
        raise ValueError(
            f"{what} must be 4k + 1 (1, 5, 9, ..., 49), got {value!r}: CogVideoX's VAE keeps the first "
            "frame and compresses the rest 4x in time"
        )


def frame_buckets(max_frames: int = 49) -> list[int]:
    """``[1, 5, 9, ..., max_frames]``: every ``4k + 1`` frame count up to ``max_frames`` (itself 4k + 1)."""
    _check_frame_bucket(max_frames, "max_frames")
    return list(range(1, max_frames + 1, 4))


def choose_frames(n_available: int, buckets: Sequence[int], *, is_image: bool = False) -> int | None:
    """The frame bucket for a clip of ``n_available`` frames, or ``None`` when none fits.

    A video gets the largest bucket ``>= 5`` (:data:`MIN_VIDEO_FRAMES`) that is ``<= n_available``;
    the 1-frame bucket is for images only (see the module docstring). An image gets 1 when 1 is a
    bucket. ``ValueError`` for a bucket that is not 4k + 1.
    """
    for b in buckets:
        _check_frame_bucket(b)
    if is_image:
        return 1 if 1 in buckets and n_available >= 1 else None
    fitting = [b for b in buckets if MIN_VIDEO_FRAMES <= b <= n_available]
    return max(fitting) if fitting else None


# ----------------------------------------------------------------- size buckets
def _check_size_buckets(buckets: Sequence[Bucket]) -> None:
    bad = [b for b in buckets if b[0] % SIZE_MULTIPLE or b[1] % SIZE_MULTIPLE]
    if bad:
        raise ValueError(
            f"video buckets need sides that are multiples of {SIZE_MULTIPLE} (VAE 8x, patch 2x2); "
            f"got {', '.join(f'{w}x{h}' for w, h in bad[:4])}"
        )


def video_size_buckets(resolution: int, step: int = 16, min_side: int = 256, max_side: int = 1360) -> list[Bucket]:
    """:func:`~difftrain.data.buckets.make_buckets` with sides that are multiples of ``step`` (a
    multiple of 16). The default ``max_side`` 1360 is CogVideoX1.5's long side (768x1360);
    ``resolution=592`` (about sqrt(480 * 720)) puts CogVideoX's 720x480 in the list."""
    if not isinstance(step, int) or step <= 0 or step % SIZE_MULTIPLE:
        raise ValueError(
            f"video bucket step must be a positive multiple of {SIZE_MULTIPLE} (VAE 8x, patch 2x2), got {step!r}"
        )
    return make_buckets(resolution, step, min_side, max_side)


def choose_video_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket with the nearest log aspect ratio to ``width`` x ``height`` (exact size first, ties
    to the larger area): :func:`~difftrain.data.buckets.nearest_bucket`, the image rule.
    ``ValueError`` for a bucket side that is not a multiple of 16, or an empty list."""
    _check_size_buckets(buckets)
    return nearest_bucket(width, height, list(buckets))


# ----------------------------------------------------------------- sampling
def sample_frame_indices(
    n_available: int, n_frames: int, mode: SampleMode = "uniform", rng: random.Random | None = None
) -> list[int]:
    """``n_frames`` strictly increasing frame indices in ``[0, n_available)``.

    * ``uniform``: index ``i`` is ``floor(i * (n_available - 1) / (n_frames - 1) + 1/2)`` (computed in
      integers), so frame 0 and the last frame are always taken and the gaps differ by at most one;
      one frame gives ``[0]``. ``rng`` is not used.
    * ``first``: ``n_frames`` consecutive frames from frame 0, or from a start drawn uniformly from
      ``[0, n_available - n_frames]`` when ``rng`` is given.

    ``ValueError`` when ``n_frames`` is not in ``[1, n_available]`` or ``mode`` is unknown.
    """
    if not isinstance(n_frames, int) or not 1 <= n_frames <= n_available:
        raise ValueError(f"cannot sample {n_frames!r} frames from a clip of {n_available} frames")
    if mode == "first":
        start = rng.randint(0, n_available - n_frames) if rng is not None else 0
        return list(range(start, start + n_frames))
    if mode != "uniform":
        raise ValueError(f"frame sampling mode must be 'uniform' or 'first', got {mode!r}")
    if n_frames == 1:
        return [0]
    span, gaps = n_available - 1, n_frames - 1
    return [(2 * i * span + gaps) // (2 * gaps) for i in range(n_frames)]


def frame_rate_varies(path: Path) -> bool:
    """Whether a video's frames are not evenly spaced in time (a variable-frame-rate file: phone recordings, screen
    captures): its packets' timestamps, demuxed and not decoded, with gaps that differ by more than half the
    typical one. Resampling to data.fps by frame count would then play parts of it too fast or too slow."""
    av = require_pyav()
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stamps = sorted(float(p.pts * p.time_base) for p in container.demux(stream) if p.pts is not None and p.size)
    gaps = sorted(b - a for a, b in pairwise(stamps) if b > a)
    if len(gaps) < 2:
        return False
    typical = gaps[len(gaps) // 2]
    return gaps[-1] - gaps[0] > 0.5 * typical


def frames_at_rate(n_available: int, fps: float, rate: float) -> int:
    """How many frames a clip of ``n_available`` frames at ``fps`` has when resampled to ``rate`` frames per
    second (data.fps): one per tick of ``rate`` from its first frame to its last."""
    return int((n_available - 1) * rate / fps + 1e-9) + 1


def resampled_indices(n_available: int, fps: float, rate: float, n_frames: int) -> list[int]:
    """The source frame nearest each of ``n_frames`` ticks of ``rate`` from the clip's start: frames are dropped to
    slow a clip's rate down, repeated to raise it, so the clip plays at its own speed at ``rate`` (as musubi-tuner's
    target_fps and diffusion-pipe's framerate resample). ``ValueError`` when the clip is too short for it."""
    if not 1 <= n_frames <= frames_at_rate(n_available, fps, rate):
        raise ValueError(f"cannot take {n_frames} frames at {rate:g} fps from {n_available} frames at {fps:g} fps")
    return [min(n_available - 1, int(j * fps / rate + 0.5)) for j in range(n_frames)]


# ----------------------------------------------------------------- scanning
def _visible(path: Path, data_dir: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(data_dir).parts)


def _list_media(data_dir: Path, recursive: bool, allow_outside: bool) -> list[Path]:
    candidates = data_dir.rglob("*") if recursive else data_dir.iterdir()
    exts = VIDEO_EXTS + CLIP_IMAGE_EXTS
    media = sorted(p for p in candidates if p.suffix.lower() in exts and _visible(p, data_dir) and p.is_file())
    for p in media if not allow_outside else ():
        check_inside(p, data_dir)
    return media


def _caption_beside(path: Path, caption_exts: Sequence[str], root: Path | None) -> str:
    for ext in caption_exts:
        text = read_text_file(path.with_suffix(ext), root)
        if text:
            return text
    return ""


def _read_lines(path: Path, root: Path | None) -> list[str]:
    """Lines of a text file (universal newlines), each stripped, trailing blank lines dropped."""
    text = read_text_file(path, root)
    if text is None:
        raise DataError(f"{path} does not exist", hint=f"put {PROMPT_FILE} and {VIDEOS_FILE} in the data folder")
    lines = [line.strip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _detect_layout(data_dir: Path, prompt_file: str, videos_file: str) -> str:
    prompts, videos = data_dir / prompt_file, data_dir / videos_file
    if prompts.is_file() and videos.is_file():
        return "factory"
    for present, missing in ((prompts, videos), (videos, prompts)):
        # prompt.txt alone is a caption only if some prompt.<video ext> sits beside it
        if present.is_file() and not any(present.with_suffix(e).is_file() for e in VIDEO_EXTS + CLIP_IMAGE_EXTS):
            raise DataError(
                f"{data_dir} has {present.name} but no {missing.name}",
                hint=f"cogvideox-factory's layout needs both {prompt_file} and {videos_file}, line-aligned",
            )
    return "folder"


def _record(
    path: Path,
    key: str,
    caption: str,
    buckets: Sequence[int],
    include_images: bool,
    exact_frames: bool,
) -> VideoRecord | str:
    """A record, or the reason the file is skipped."""
    if path.suffix.lower() in CLIP_IMAGE_EXTS:
        if not include_images:
            return "an image, and include_images is off"
        try:
            width, height = read_image_size(path)
        except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad files
            return f"not a readable image: {exc}"
        if choose_frames(1, buckets, is_image=True) is None:
            return "an image, and 1 is not one of the frame buckets"
        return VideoRecord(key, path, caption, width, height, 1, 0.0, True)
    if path.suffix.lower() not in VIDEO_EXTS:
        return f"not a video ({', '.join(VIDEO_EXTS)}) or image ({', '.join(CLIP_IMAGE_EXTS)})"
    try:
        width, height, frames, fps = probe_video(path, exact_frames=exact_frames)
    except BackendUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - PyAV/FFmpeg raise many types for bad files
        return _unreadable_reason(path, exc)
    if choose_frames(frames, buckets) is None:
        usable = [b for b in buckets if b >= MIN_VIDEO_FRAMES]
        smallest = min(usable) if usable else None
        return (
            f"{frames} frames, shorter than the smallest frame bucket ({smallest})"
            if smallest is not None
            else f"no frame bucket of at least {MIN_VIDEO_FRAMES} frames for a video"
        )
    return VideoRecord(key, path, caption, width, height, frames, fps, False)


def scan_videos(
    data_dir: Path,
    *,
    caption_ext: str = ".txt",
    layout: Layout = "auto",
    buckets: Sequence[int] | None = None,
    include_images: bool = True,
    recursive: bool = True,
    exact_frames: bool = False,
    prompt_file: str = PROMPT_FILE,
    videos_file: str = VIDEOS_FILE,
    allow_outside: bool = False,
) -> tuple[list[VideoRecord], list[tuple[Path, str]]]:
    """Scan ``data_dir`` for clips; return ``(records, skipped)`` with ``skipped = [(path, reason)]``.

    ``layout`` ``"auto"`` picks cogvideox-factory's when both ``prompt_file`` and ``videos_file``
    exist in ``data_dir``, else the folder layout (see the module docstring for both). ``buckets``
    are the frame buckets (default :func:`frame_buckets` ``(49)``); a video is skipped when
    :func:`choose_frames` finds none for it, i.e. it is shorter than the smallest usable bucket.
    ``recursive`` applies to the folder layout; hidden files and folders are left out.

    Skipped, not raised: a file that cannot be opened or whose first frame does not decode, a
    file with no video stream, a too-short video, a missing file or blank line in ``videos_file``,
    a second file with the same key (``a.mp4`` beside ``a.png``, or a repeated line), and images
    when ``include_images`` is off.

    Raises :class:`DataError` when ``data_dir`` is not a folder or holds no clips, when
    ``prompt_file`` and ``videos_file`` have different numbers of lines (trailing blank lines
    aside), or when only one of them exists; :class:`BackendUnavailable` without PyAV. Unless
    ``allow_outside``, also for a ``videos_file`` line, clip or caption file that leads outside ``data_dir``.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(
            f"data folder {data_dir} does not exist or is not a folder", hint="pass the folder that holds your videos"
        )
    buckets = list(frame_buckets(49) if buckets is None else buckets)
    for b in buckets:
        _check_frame_bucket(b)
    if layout == "auto":
        layout = _detect_layout(data_dir, prompt_file, videos_file)  # type: ignore[assignment]
    if layout not in ("factory", "folder"):
        raise ValueError(f"layout must be 'auto', 'factory' or 'folder', got {layout!r}")

    entries = (
        _factory_entries(data_dir, prompt_file, videos_file, allow_outside)
        if layout == "factory"
        else _folder_entries(data_dir, normalize_ext(caption_ext), recursive, allow_outside)
    )
    records: list[VideoRecord] = []
    skipped: list[tuple[Path, str]] = []
    seen: dict[str, Path] = {}
    for path, key, caption, problem in entries:
        if problem is not None:
            skipped.append((path, problem))
            continue
        if key in seen:
            skipped.append((path, f"same key {key!r} as {seen[key]}; rename one of them"))
            continue
        result = _record(path, key, caption, buckets, include_images, exact_frames)
        if isinstance(result, str):
            skipped.append((path, result))
            continue
        seen[key] = path
        records.append(result)
    return records, skipped


_Entry = tuple[Path, str, str, str | None]  # (path, key, caption, reason to skip or None)


def _folder_entries(data_dir: Path, caption_ext: str, recursive: bool, allow_outside: bool) -> list[_Entry]:
    media = _list_media(data_dir, recursive, allow_outside)
    if not media:
        raise DataError(
            f"no videos ({', '.join(VIDEO_EXTS)}) or images ({', '.join(CLIP_IMAGE_EXTS)}) in {data_dir}"
            + ("" if recursive else " (sub-folders not searched)"),
            hint=f"check data.dir, or use cogvideox-factory's layout ({PROMPT_FILE} + {VIDEOS_FILE})",
        )
    caption_exts = list(dict.fromkeys([caption_ext, ".txt", ".caption"]))
    root = None if allow_outside else data_dir
    return [(p, record_key(p, data_dir), _caption_beside(p, caption_exts, root), None) for p in media]


def _factory_entries(data_dir: Path, prompt_file: str, videos_file: str, allow_outside: bool) -> list[_Entry]:
    prompt_path, videos_path = data_dir / prompt_file, data_dir / videos_file
    root = None if allow_outside else data_dir
    prompts, videos = _read_lines(prompt_path, root), _read_lines(videos_path, root)
    if len(prompts) != len(videos):
        raise DataError(
            f"{prompt_path} has {len(prompts)} prompts but {videos_path} lists {len(videos)} videos; "
            "line N of each file must describe the same clip",
            hint="add the missing lines or remove the extra ones (blank lines at the end are ignored)",
        )
    if not videos:
        raise DataError(f"{videos_path} lists no videos", hint="one video path per line, relative to the data folder")
    entries: list[_Entry] = []
    for line_no, (prompt, video) in enumerate(zip(prompts, videos), start=1):
        if not video or "\0" in video:
            entries.append(
                (videos_path, "", "", f"line {line_no} of {videos_file} is " + ("blank" if not video else "not a path"))
            )
            continue
        path = data_dir / video
        if not allow_outside and not is_inside(path, data_dir):
            raise DataError(
                f"{videos_path} line {line_no}: {video!r} leads outside the data folder {data_dir}", hint=OUTSIDE_HINT
            )
        if not path.is_file():
            entries.append((path, "", prompt, f"listed on line {line_no} of {videos_file}, but there is no such file"))
            continue
        try:
            key = record_key(path, data_dir)
        except ValueError:  # outside the data folder (absolute, or ../)
            key = Path(video).with_suffix("").as_posix()
        entries.append((path, key, prompt, None))
    return entries


# ----------------------------------------------------------------- decoding
def _check_indices(indices: Sequence[int]) -> list[int]:
    indices = list(indices)
    if not indices or indices[0] < 0 or any(b <= a for a, b in pairwise(indices)):
        raise ValueError(f"frame indices must be non-empty, non-negative and strictly increasing, got {indices}")
    return indices


def _decode_frames(record: VideoRecord, indices: list[int]) -> list[np.ndarray]:
    """The upright RGB frames at ``indices``, decoding sequentially up to the last one."""
    av = require_pyav()
    wanted, last = set(indices), indices[-1]
    out: list[np.ndarray] = []
    decoded = 0
    try:
        with av.open(str(record.path)) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            decoding = container.decode(stream)
            reformatter = av.video.reformatter.VideoReformatter()  # this clip's own (_rgb_frame)
            try:
                for i, frame in enumerate(decoding):
                    decoded = i + 1
                    if i in wanted:
                        out.append(_rgb_frame(frame, reformatter))
                    if i >= last:
                        break
            finally:
                decoding.close()  # before the container closes
    except Exception as exc:
        raise DataError(
            f"cannot decode video {record.path} (stopped after {decoded} frames): {exc}",
            hint="re-encode the file (e.g. ffmpeg -i in.mp4 -c:v libx264 out.mp4), or remove it",
        ) from exc
    if len(out) < len(indices):
        raise DataError(
            f"video {record.path} ended after {decoded} frames, but frame {indices[len(out)]} was asked for "
            f"(the scan counted {record.frames})",
            hint="rescan with exact_frames=True to count frames by decoding, or re-encode the file",
        )
    return out


def load_clip(
    record: VideoRecord,
    frame_indices: Sequence[int],
    bucket_wh: Bucket,
    rng: random.Random | None = None,
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Decode ``frame_indices`` of ``record`` and fit them to ``bucket_wh`` (width, height).

    Returns ``(clip, (crop_top, crop_left))``: ``clip`` is ``[3, F, H, W]`` float32 in ``[-1, 1]``
    with ``F = len(frame_indices)`` (an image gives ``F = 1`` and takes only ``[0]``), and the crop
    offset is in resized coordinates, as :func:`~difftrain.data.buckets.fit_to_bucket` returns it.
    Every frame is resized to cover the bucket and cropped -- centred, or at one random offset
    shared by all frames when ``rng`` is given. Only the frames up to the last index are decoded,
    and only the asked ones are converted to RGB.

    Raises :class:`DataError` naming the file when decoding fails or the video ends before the last
    index; ``ValueError`` for indices that decrease or start below 0 (a repeated index repeats its frame).
    """
    if list(frame_indices) != sorted(frame_indices):
        _check_indices(frame_indices)  # words it
    # a frame may repeat (a clip resampled to a higher rate, data.fps): each distinct one is decoded once
    indices = _check_indices(sorted(set(frame_indices)))
    if record.is_image:
        if indices != [0] or len(frame_indices) != 1:
            raise ValueError(f"{record.path} is an image: its only frame is [0], got {list(frame_indices)}")
        frames = [load_rgb(record.path)]
    else:
        decoded = dict(zip(indices, _decode_frames(record, indices)))
        frames = [Image.fromarray(decoded[i]) for i in frame_indices]
    seed = rng.getrandbits(64) if rng is not None else None
    fitted: list[np.ndarray] = []
    crop = (0, 0)
    for n, image in enumerate(frames):
        # one seed for all frames: frames of equal size get the same crop
        image, offsets = fit_to_bucket(image, bucket_wh, None if seed is None else random.Random(seed))
        if n == 0:
            crop = offsets
        fitted.append(np.asarray(image, dtype=np.uint8))
    clip = torch.from_numpy(np.stack(fitted)).permute(3, 0, 1, 2).float()  # [F, H, W, 3] -> [3, F, H, W]
    return clip / 127.5 - 1.0, crop


def write_mp4(path: Path, frames, fps: int) -> Path:
    """Frames [F, H, W, 3] (floats in [0, 1] or uint8) as an H.264 mp4 (mpeg4 where this FFmpeg has no
    libx264), written to a temporary name and renamed. Odd sides are padded to even (yuv420p needs it)."""
    import os

    import numpy as np

    av = require_pyav()
    arr = np.asarray(frames)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0, 1) * 255).round().astype(np.uint8)
    _f, h, w, _ = arr.shape
    arr = np.pad(arr, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(tmp), "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = arr.shape[2], arr.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in arr:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)
    return path
