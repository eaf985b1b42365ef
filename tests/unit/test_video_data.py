"""Video data: both dataset layouts, skipped files, frame/size buckets, frame sampling, clip decoding.

The test videos are tiny (64x48, 8 fps) and encoded nearly losslessly; frame ``i`` is a solid grey
of level ``_level(i)``, so which frames were decoded can be read back from their colour.
"""

from __future__ import annotations

import random
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

av = pytest.importorskip("av")

from difftrain.data.video import (  # noqa: E402 (after the importorskip)
    VideoRecord,
    choose_frames,
    choose_video_bucket,
    frame_buckets,
    frames_at_rate,
    load_clip,
    probe_video,
    resampled_indices,
    sample_frame_indices,
    scan_videos,
    video_size_buckets,
)
from difftrain.errors import DataError  # noqa: E402

W, H = 64, 48
TOL = 4  # grey levels are 10 apart; yuv420p round trips are within a few levels
_CODEC = next((c for c in ("libx264", "mpeg4") if c in av.codecs_available), None)
_MKV_CODEC = "ffv1" if "ffv1" in av.codecs_available else _CODEC


def _level(i: int) -> int:
    return 8 + 10 * i


def _video(
    path: Path,
    n_frames: int,
    *,
    codec: str | None = None,
    size: tuple[int, int] = (W, H),
    rotation: int | None = None,
    marker: bool = False,
) -> Path:
    """Frame i is solid grey _level(i); ``marker`` paints the top 8 rows white."""
    codec = codec or _CODEC
    if codec is None:
        pytest.skip("this PyAV build has neither libx264 nor mpeg4")
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv444p" if codec == "ffv1" else "yuv420p"
        if codec == "libx264":
            stream.options = {"qp": "0"}
        elif codec == "mpeg4":
            stream.options = {"qscale": "1"}
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i in range(n_frames):
            pixels = np.full((size[1], size[0], 3), _level(i), np.uint8)
            if marker:
                pixels[:8] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _levels(clip: torch.Tensor) -> list[int]:
    """Mean grey level of each frame of a [3, F, H, W] clip in [-1, 1]."""
    return [round(float((clip[:, f].mean() + 1) * 127.5)) for f in range(clip.shape[1])]


def _assert_frames(clip: torch.Tensor, indices: list[int]) -> None:
    got = _levels(clip)
    assert all(abs(g - _level(i)) <= TOL for g, i in zip(got, indices)), (got, [_level(i) for i in indices])


# ----------------------------------------------------------------- frame buckets
def test_frame_buckets_are_4k_plus_1():
    assert frame_buckets() == [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]
    assert frame_buckets(1) == [1]
    assert frame_buckets(13) == [1, 5, 9, 13]
    for bad in (0, 48, 50, True):
        with pytest.raises(ValueError, match="4k \\+ 1"):
            frame_buckets(bad)


@pytest.mark.parametrize(
    ("n_available", "expected"),
    [(12, 9), (13, 13), (5, 5), (8, 5), (4, None), (1, None), (48, 45), (49, 49), (1000, 49)],
)
def test_choose_frames_largest_bucket_that_fits(n_available, expected):
    assert choose_frames(n_available, frame_buckets(49)) == expected


def test_choose_frames_images_get_one_and_videos_never_do():
    buckets = frame_buckets(49)
    assert choose_frames(1, buckets, is_image=True) == 1
    assert choose_frames(3, buckets) is None  # a 3-frame video is not turned into a still
    assert choose_frames(100, [1]) is None
    assert choose_frames(30, [49]) is None and choose_frames(60, [49]) == 49
    assert choose_frames(1, [5, 9], is_image=True) is None
    with pytest.raises(ValueError, match="4k \\+ 1"):
        choose_frames(10, [1, 6])


# ----------------------------------------------------------------- size buckets
def test_video_size_buckets_are_multiples_of_16():
    buckets = video_size_buckets(512, min_side=256, max_side=1024)
    assert buckets and all(w % 16 == 0 and h % 16 == 0 and w * h <= 512 * 512 for w, h in buckets)
    assert (720, 480) in video_size_buckets(592)
    with pytest.raises(ValueError, match="multiple of 16"):
        video_size_buckets(512, step=8)


def test_choose_video_bucket_nearest_aspect_ratio():
    buckets = video_size_buckets(592)
    assert choose_video_bucket(720, 480, buckets) == (720, 480)  # exact size first
    w, h = choose_video_bucket(1920, 1080, buckets)
    assert abs(w / h - 16 / 9) < 0.05
    w, h = choose_video_bucket(1080, 1920, buckets)
    assert abs(h / w - 16 / 9) < 0.05
    assert choose_video_bucket(64, 48, [(32, 32), (64, 48), (48, 64)]) == (64, 48)
    assert choose_video_bucket(640, 480, [(32, 32), (64, 48), (48, 64)]) == (64, 48)
    with pytest.raises(ValueError, match="multiples of 16"):
        choose_video_bucket(64, 48, [(64, 40)])


# ----------------------------------------------------------------- sampling
def test_uniform_sampling_formula():
    assert sample_frame_indices(24, 5) == [0, 6, 12, 17, 23]  # round-half-up of i * 23 / 4
    assert sample_frame_indices(12, 9) == [0, 1, 3, 4, 6, 7, 8, 10, 11]
    assert sample_frame_indices(49, 49) == list(range(49))
    assert sample_frame_indices(10, 1) == [0]
    assert sample_frame_indices(97, 49) == list(range(0, 97, 2))


def test_uniform_sampling_is_strictly_increasing_and_spans_the_clip():
    for n in range(1, 80):
        for f in range(1, n + 1):
            idx = sample_frame_indices(n, f)
            assert len(idx) == f and idx[0] == 0 and all(b > a for a, b in pairwise(idx))
            assert idx[-1] == (n - 1 if f > 1 else 0)


def test_first_sampling_and_random_window():
    assert sample_frame_indices(24, 5, "first") == [0, 1, 2, 3, 4]
    rng = random.Random(0)
    starts = set()
    for _ in range(50):
        idx = sample_frame_indices(24, 5, "first", rng)
        assert idx == list(range(idx[0], idx[0] + 5)) and 0 <= idx[0] <= 19
        starts.add(idx[0])
    assert len(starts) > 5


def test_sampling_errors():
    with pytest.raises(ValueError, match="cannot sample"):
        sample_frame_indices(4, 5)
    with pytest.raises(ValueError, match="cannot sample"):
        sample_frame_indices(4, 0)
    with pytest.raises(ValueError, match="'uniform' or 'first'"):
        sample_frame_indices(10, 5, "random")


# ----------------------------------------------------------------- scanning: folder layout
def test_folder_layout_with_captions_images_and_bad_files(tmp_path):
    _video(tmp_path / "a.mp4", 12)
    _write(tmp_path / "a.txt", "a grey fade")
    _video(tmp_path / "sub" / "b.mkv", 21, codec=_MKV_CODEC)  # Matroska stores no frame count
    _write(tmp_path / "sub" / "b.caption", "from .caption")
    Image.new("RGB", (40, 30), (1, 2, 3)).save(tmp_path / "still.png")
    _write(tmp_path / "still.txt", "a still")
    (tmp_path / "bad.mp4").write_bytes(random.Random(0).randbytes(4096))
    (tmp_path / "empty.webm").write_bytes(b"")
    _video(tmp_path / "short.mp4", 3)
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")  # same key as a.mp4, sorted after it
    _video(tmp_path / ".hidden" / "h.mp4", 12)

    records, skipped = scan_videos(tmp_path)

    by_key = {r.key: r for r in records}
    assert list(by_key) == ["a", "still", "sub/b"]
    a = by_key["a"]
    assert (a.path, a.caption, a.width, a.height, a.frames, a.fps, a.is_image) == (
        tmp_path / "a.mp4",
        "a grey fade",
        W,
        H,
        12,
        8.0,
        False,
    )
    b = by_key["sub/b"]
    assert (b.caption, b.frames, b.width, b.height, b.fps) == ("from .caption", 21, W, H, 8.0)
    assert by_key["still"] == VideoRecord("still", tmp_path / "still.png", "a still", 40, 30, 1, 0.0, True)

    reasons = {p.name: why for p, why in skipped}
    assert set(reasons) == {"bad.mp4", "empty.webm", "short.mp4", "a.png"}
    assert "not a readable video" in reasons["bad.mp4"]
    assert reasons["empty.webm"] == "empty file (0 bytes)"
    assert reasons["short.mp4"] == "3 frames, shorter than the smallest frame bucket (5)"
    assert "same key 'a'" in reasons["a.png"]

    assert [r.key for r in scan_videos(tmp_path, recursive=False)[0]] == ["a", "still"]
    no_images, skipped = scan_videos(tmp_path, include_images=False)
    assert "still" not in {r.key for r in no_images}
    assert "include_images is off" in {p.name: w for p, w in skipped}["still.png"]
    only_49, skipped = scan_videos(tmp_path, buckets=[1, 49])
    # a.mp4 is too short now, so the a.png beside it no longer clashes and is kept
    assert [(r.key, r.is_image) for r in only_49] == [("a", True), ("still", True)]
    assert "12 frames, shorter than the smallest frame bucket (49)" in [w for _, w in skipped]


def test_records_are_frozen_and_caption_ext_is_tried_first(tmp_path):
    _video(tmp_path / "a.mp4", 6)
    _write(tmp_path / "a.txt", "txt")
    _write(tmp_path / "a.desc", "desc")
    records, _ = scan_videos(tmp_path, caption_ext="desc")
    assert records[0].caption == "desc"
    with pytest.raises(AttributeError):
        records[0].caption = "x"  # type: ignore[misc]


def test_no_video_stream_is_skipped(tmp_path):
    path = tmp_path / "audio.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in list(stream.encode(frame)) + list(stream.encode()):
            container.mux(packet)
    _video(tmp_path / "ok.mp4", 5)
    records, skipped = scan_videos(tmp_path)
    assert [r.key for r in records] == ["ok"]
    assert skipped == [(path, "no video stream")]


def test_empty_or_missing_folder_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        scan_videos(tmp_path / "nope")
    _write(tmp_path / "notes.md", "x")
    with pytest.raises(DataError, match="no videos"):
        scan_videos(tmp_path)


# ----------------------------------------------------------------- scanning: cogvideox-factory layout
def test_factory_layout_line_aligned(tmp_path):
    _video(tmp_path / "videos" / "one.mp4", 12)
    _video(tmp_path / "videos" / "two.mp4", 9)
    _video(tmp_path / "videos" / "short.mp4", 3)
    _write(tmp_path / "prompt.txt", "first prompt\r\nsecond prompt\nthird\nfourth\n\n\n")
    _write(tmp_path / "videos.txt", "videos/one.mp4\nvideos/two.mp4\nvideos/short.mp4\nvideos/missing.mp4\n\n")
    # files beside the clips are not read in this layout
    _write(tmp_path / "videos" / "one.txt", "sidecar, ignored")

    records, skipped = scan_videos(tmp_path)

    assert [(r.key, r.caption, r.frames) for r in records] == [
        ("videos/one", "first prompt", 12),
        ("videos/two", "second prompt", 9),
    ]
    assert records[0].path == tmp_path / "videos" / "one.mp4"
    reasons = {p.name: why for p, why in skipped}
    assert reasons["short.mp4"].startswith("3 frames")
    assert reasons["missing.mp4"] == "listed on line 4 of videos.txt, but there is no such file"


def test_factory_layout_length_mismatch_names_counts_and_files(tmp_path):
    _video(tmp_path / "a.mp4", 5)
    _write(tmp_path / "prompt.txt", "one\ntwo\nthree\n")
    _write(tmp_path / "videos.txt", "a.mp4\na.mp4\n\n")
    with pytest.raises(DataError, match=r"prompt\.txt has 3 prompts but .*videos\.txt lists 2 videos") as info:
        scan_videos(tmp_path)
    assert "blank lines at the end" in info.value.hint


def test_factory_layout_blank_middle_line_keeps_alignment_and_duplicates_skip(tmp_path):
    _video(tmp_path / "a.mp4", 5)
    _video(tmp_path / "b.mp4", 5)
    _write(tmp_path / "prompt.txt", "for a\nfor nothing\nfor b\nagain a\n")
    _write(tmp_path / "videos.txt", "a.mp4\n\nb.mp4\na.mp4\n")
    records, skipped = scan_videos(tmp_path)
    assert [(r.key, r.caption) for r in records] == [("a", "for a"), ("b", "for b")]
    assert skipped[0] == (tmp_path / "videos.txt", "line 2 of videos.txt is blank")
    assert skipped[1][0] == tmp_path / "a.mp4" and "same key 'a'" in skipped[1][1]


def test_factory_layout_half_present_is_a_data_error(tmp_path):
    _video(tmp_path / "a.mp4", 5)
    _write(tmp_path / "videos.txt", "a.mp4\n")
    with pytest.raises(DataError, match=r"has videos\.txt but no prompt\.txt"):
        scan_videos(tmp_path)
    # prompt.txt beside prompt.mp4 is just that clip's caption
    (tmp_path / "videos.txt").unlink()
    _video(tmp_path / "prompt.mp4", 5)
    _write(tmp_path / "prompt.txt", "caption of prompt.mp4")
    records, _ = scan_videos(tmp_path)
    assert {r.key: r.caption for r in records} == {"a": "", "prompt": "caption of prompt.mp4"}


# ----------------------------------------------------------------- probing
def test_probe_counts_packets_when_the_container_has_no_count(tmp_path):
    path = _video(tmp_path / "c.mkv", 17, codec=_MKV_CODEC)
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0  # why the packet count is needed
    assert probe_video(path) == (W, H, 17, 8.0)
    assert probe_video(path, exact_frames=True) == (W, H, 17, 8.0)


# ----------------------------------------------------------------- load_clip
def _record(tmp_path: Path, n_frames: int, name: str = "v.mp4", **kw) -> VideoRecord:
    _video(tmp_path / name, n_frames, **kw)
    records, skipped = scan_videos(tmp_path)
    assert not skipped
    return next(r for r in records if r.path.name == name)


def test_load_clip_uniform_and_first_pick_the_expected_frames(tmp_path):
    record = _record(tmp_path, 24)
    uniform = sample_frame_indices(record.frames, 5, "uniform")
    clip, crop = load_clip(record, uniform, (W, H))
    assert clip.shape == (3, 5, H, W) and clip.dtype == torch.float32
    assert crop == (0, 0)
    _assert_frames(clip, [0, 6, 12, 17, 23])

    first, _ = load_clip(record, sample_frame_indices(record.frames, 5, "first"), (W, H))
    _assert_frames(first, [0, 1, 2, 3, 4])


def test_load_clip_resizes_to_cover_and_centre_crops(tmp_path):
    record = _record(tmp_path, 9)
    clip, crop = load_clip(record, [0, 4, 8], (32, 32))
    assert clip.shape == (3, 3, 32, 32)
    assert crop == (0, 5)  # 64x48 -> 43x32 (height matches), (43 - 32) // 2 = 5 from the left
    assert clip.min() >= -1 and clip.max() <= 1
    _assert_frames(clip, [0, 4, 8])


def test_random_crop_is_one_offset_for_every_frame(tmp_path):
    record = _record(tmp_path, 5, marker=True)  # white band in the top 8 rows of every frame
    tops = set()
    for seed in range(8):
        clip, (top, left) = load_clip(record, [0, 2, 4], (32, 16), rng=random.Random(seed))
        assert clip.shape == (3, 3, 16, 32) and left == 0 and 0 <= top <= 8  # 64x48 -> 32x24, crop 16 rows
        white_rows = [tuple(((clip[0, f].mean(dim=1) + 1) * 127.5 > 200).tolist()) for f in range(3)]
        assert white_rows[0] == white_rows[1] == white_rows[2]
        tops.add(top)
    assert len(tops) > 1


def test_clip_that_is_not_4k_plus_1_gets_the_largest_bucket(tmp_path):
    record = _record(tmp_path, 12)  # 12 frames: 9 is the largest 4k + 1 that fits
    n = choose_frames(record.frames, frame_buckets(49))
    assert n == 9
    indices = sample_frame_indices(record.frames, n)
    clip, _ = load_clip(record, indices, choose_video_bucket(record.width, record.height, [(64, 48), (48, 64)]))
    assert clip.shape == (3, 9, 48, 64)
    _assert_frames(clip, indices)


def test_image_record_is_one_frame(tmp_path):
    Image.new("RGB", (80, 40), (255, 0, 0)).save(tmp_path / "red.jpg")
    record = scan_videos(tmp_path)[0][0]
    assert record.is_image and record.frames == 1
    clip, crop = load_clip(record, [0], (32, 32))
    assert clip.shape == (3, 1, 32, 32) and crop == (0, 16)
    assert clip[0].mean() > 0.9 and clip[1].mean() < -0.9
    with pytest.raises(ValueError, match="is an image"):
        load_clip(record, [0, 1], (32, 32))


def test_load_clip_checks_indices(tmp_path):
    record = _record(tmp_path, 5)
    for bad in ([], [3, 2], [-1, 0], [1, 1, 0]):
        with pytest.raises(ValueError, match="strictly increasing"):
            load_clip(record, bad, (W, H))


def test_resampling_to_a_frame_rate_drops_or_repeats_frames(tmp_path):
    """data.fps: one frame per tick of the new rate from the clip's start, the nearest source frame."""
    assert (
        frames_at_rate(24, 8.0, 4.0) == 12 and frames_at_rate(24, 8.0, 16.0) == 47 and frames_at_rate(81, 16, 16) == 81
    )
    assert frames_at_rate(121, 30.0, 16.0) == 65  # 4 s of 30 fps: 64 ticks of 16 fps after the first frame
    assert resampled_indices(24, 8.0, 4.0, 9) == [0, 2, 4, 6, 8, 10, 12, 14, 16]
    assert resampled_indices(24, 8.0, 16.0, 5) == [0, 1, 1, 2, 2]
    assert resampled_indices(121, 30.0, 16.0, 5) == [0, 2, 4, 6, 8]  # 1.875 source frames a tick
    with pytest.raises(ValueError, match="cannot take 13 frames at 4 fps"):
        resampled_indices(24, 8.0, 4.0, 13)
    record = _record(tmp_path, 5)
    clip, _ = load_clip(record, [0, 1, 1, 2, 2], (W, H))  # a repeated index repeats its frame
    _assert_frames(clip, [0, 1, 1, 2, 2])


def test_placement_with_data_fps_takes_the_resampled_frames_and_names_short_clips(tmp_path):
    from difftrain.config.schema import DataConfig
    from difftrain.precompute.plan import buckets_for, place

    long, short = _record(tmp_path, 24, "long.mp4"), _record(tmp_path, 8, "short.mp4")  # 8 fps
    d = DataConfig(dir=tmp_path, resolution=64, bucket_step=16, min_side=32, max_side=128, frames=9, fps=4)
    buckets = buckets_for(d, video=True)
    p = place(long, False, d, buckets)
    assert p.frames == 9 and p.indices == [0, 2, 4, 6, 8, 10, 12, 14, 16]
    why = place(short, False, d, buckets)
    assert isinstance(why, str) and "4 at data.fps 4, from 8 at 8 fps" in why
    plain = place(long, False, d.model_copy(update={"fps": None}), buckets)
    assert plain.indices == sample_frame_indices(24, 9)


def test_video_that_ends_early_is_a_data_error_naming_the_file(tmp_path):
    path = _video(tmp_path / "cut.mkv", 24, codec=_MKV_CODEC)
    record = scan_videos(tmp_path)[0][0]
    assert record.frames == 24
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # the file is cut after scanning
    with pytest.raises(DataError, match=r"cut\.mkv ended after \d+ frames, but frame 6 was asked for") as info:
        load_clip(record, sample_frame_indices(24, 5), (W, H))
    assert "exact_frames" in info.value.hint


def test_display_rotation_gives_upright_size_and_frames(tmp_path):
    # a portrait phone clip: landscape pixels plus a display matrix that turns them 90 degrees clockwise
    record = _record(tmp_path, 5, rotation=-90, marker=True)
    assert (record.width, record.height) == (H, W)
    clip, _ = load_clip(record, [0], (H, W))
    assert clip.shape == (3, 1, W, H)
    frame = (clip[0, 0] + 1) * 127.5  # the white top band of the stored frame is now the right band
    assert frame[:, -6:].mean() > 240 and frame[:, :-10].mean() < 40


def _vfr_video(path: Path, gaps_ms: list[int]) -> Path:
    """A clip whose frames are ``gaps_ms`` apart (milliseconds, one per frame after the first)."""
    from fractions import Fraction

    if _CODEC is None:
        pytest.skip("this PyAV build has neither libx264 nor mpeg4")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(_CODEC, rate=30)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.time_base = Fraction(1, 1000)
        t = 0
        for i, gap in enumerate([0, *gaps_ms]):
            t += gap
            frame = av.VideoFrame.from_ndarray(np.full((H, W, 3), _level(i), np.uint8), format="rgb24")
            frame.pts, frame.time_base = t, Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_a_variable_frame_rate_clip_is_skipped_by_name_when_data_fps_resamples(tmp_path):
    from difftrain.config.schema import DataConfig
    from difftrain.data.video import frame_rate_varies
    from difftrain.precompute.plan import buckets_for, place

    vfr = _vfr_video(tmp_path / "phone.mp4", [33] * 10 + [100] * 10)
    even = _vfr_video(tmp_path / "even.mp4", [33] * 20)
    assert frame_rate_varies(vfr) and not frame_rate_varies(even)
    records = {r.path.name: r for r in scan_videos(tmp_path)[0]}
    d = DataConfig(dir=tmp_path, resolution=64, bucket_step=16, min_side=32, max_side=128, frames=9, fps=16)
    why = place(records["phone.mp4"], False, d, buckets_for(d, video=True))
    assert isinstance(why, str) and "frame rate varies" in why and "ffmpeg -i IN -vf fps=16 OUT" in why
    assert not isinstance(place(records["even.mp4"], False, d, buckets_for(d, video=True)), str)
    # without data.fps the clip is taken as its frames come (nothing resampled, nothing asked)
    assert not isinstance(
        place(records["phone.mp4"], False, d.model_copy(update={"fps": None}), buckets_for(d, True)), str
    )


def test_flip_aug_mirrors_every_frame_of_a_clip_after_its_crop(tmp_path):
    """precompute's decoder with flip_aug's mirrored job: each frame of the fitted clip flipped left-right, its crop
    the unflipped one's."""
    from difftrain.precompute.pipeline import DecodeSet

    if _CODEC is None:
        pytest.skip("this PyAV build has neither libx264 nor mpeg4")
    with av.open(str(tmp_path / "v.mp4"), "w") as container:  # a white band at the left of every frame
        stream = container.add_stream(_CODEC, rate=8)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(5):
            pixels = np.full((H, W, 3), _level(i), np.uint8)
            pixels[:, :16] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    (record,), _ = scan_videos(tmp_path)
    jobs = [("own", record, (32, 32), [0, 2, 4], "sha"), ("mirrored", record, (32, 32), [0, 2, 4], "sha", True)]
    decoder = DecodeSet(jobs, video=True, random_crop=False)
    own, mirrored = decoder[0], decoder[1]
    assert own["pixels"].shape == (3, 3, 32, 32) and own["crop"] == mirrored["crop"]
    assert torch.equal(mirrored["pixels"], own["pixels"].flip(-1))
    for f in range(3):  # the band on the left of each frame, on the right once mirrored
        left, right = own["pixels"][:, f, :, :4].mean(), own["pixels"][:, f, :, -4:].mean()
        assert left > right
        assert mirrored["pixels"][:, f, :, -4:].mean() == left


# A process that converted a frame through PyAV's own reformatter (PyAV keeps one per process, its FFmpeg scaler with
# slice threads), then decodes in precompute's forked workers. Run in a child process with a time limit: before the fix
# the worker waited forever for the scaler threads the fork did not copy, and here that fails instead of hanging
_FORKED_DECODE = """
import sys
from pathlib import Path
import av
from difftrain.data.video import scan_videos
from difftrain.precompute.pipeline import decoded_batches

folder = Path(sys.argv[1])
with av.open(str(folder / "v.mp4")) as c:  # a conversion in this process before it forks
    next(iter(c.decode(video=0))).to_ndarray(format="rgb24")
(record,), _ = scan_videos(folder)
jobs = [("a", record, (32, 32), [0, 2, 4], "sha"), ("b", record, (32, 32), [1, 3], "sha")]
batches = list(decoded_batches(jobs, [1, 2], 1, video=True, random_crop=False, workers=2, pin=False))
print(sorted(tuple(b["pixels"].shape) for b in batches), sum(len(b["errors"]) for b in batches))
"""


def test_forked_decoding_workers_convert_frames_after_the_parent_has(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    _video(tmp_path / "v.mp4", 6)
    p = subprocess.Popen(
        [sys.executable, "-c", _FORKED_DECODE, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its workers too are stopped if it hangs
    )
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail("precompute's forked decoding workers hung converting frames (PyAV's scaler threads)")
    assert p.returncode == 0, err[-2000:]
    assert out.split("\n")[0] == "[(1, 3, 2, 32, 32), (1, 3, 3, 32, 32)] 0", out
