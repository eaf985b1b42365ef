"""A dataset cannot make difftrain read files outside its folder: links out of it, videos.txt lines with absolute or
../ paths and metadata keys naming other folders are refused (DataError naming the file and the entry) unless
data.allow_outside_paths; links inside the folder are fine; devices and pipes are never read as captions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from difftrain.data.paths import read_text_file
from difftrain.data.sources import scan_dataset
from difftrain.data.tags import merge_tags
from difftrain.data.video import scan_videos
from difftrain.errors import DataError


def _img(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), (1, 2, 3)).save(path)
    return path


@pytest.fixture
def folders(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "private"
    _img(data / "a.png")
    (data / "a.caption").write_text("a cat")
    _img(outside / "secret.png")
    (outside / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    return data, outside


def test_a_caption_link_out_of_the_folder_is_refused_by_scan_and_merge_tags(folders, tmp_path):
    data, outside = folders
    (data / "a.txt").symlink_to(outside / "id_rsa")
    for run in (lambda **kw: scan_dataset(data, **kw), lambda **kw: merge_tags(data, tmp_path / "m.json", **kw)):
        with pytest.raises(DataError, match=r"a\.txt leads to .*private/id_rsa, outside the data folder") as e:
            run()
        assert "allow_outside_paths" in e.value.hint
    assert not (tmp_path / "m.json").exists()
    records, _ = scan_dataset(data, allow_outside=True)  # the user's own links, when asked
    assert records[0].caption == "a cat"
    merge_tags(data, tmp_path / "m.json", allow_outside=True)
    assert "BEGIN OPENSSH" in json.loads((tmp_path / "m.json").read_text())["a"]["tags"]


def test_an_image_link_out_of_the_folder_is_refused_one_inside_is_fine(folders):
    data, outside = folders
    (data / "b.png").symlink_to(data / "a.png")  # inside: fine
    assert [r.key for r in scan_dataset(data)[0]] == ["a", "b"]
    (data / "c.png").symlink_to(outside / "secret.png")
    with pytest.raises(DataError, match=r"c\.png leads to .*secret\.png, outside the data folder"):
        scan_dataset(data)
    assert [r.key for r in scan_dataset(data, allow_outside=True)[0]] == ["a", "b", "c"]


def test_linked_folders_are_not_followed(folders):
    data, outside = folders
    (data / "more").symlink_to(outside, target_is_directory=True)
    assert [r.key for r in scan_dataset(data)[0]] == ["a"]


def test_a_pipe_or_device_named_like_a_caption_is_refused_not_read(folders):
    data, _ = folders
    os.mkfifo(data / "a.txt")  # reading it would block forever
    with pytest.raises(DataError, match=r"a\.txt is not a regular file"):
        scan_dataset(data)
    (data / "a.txt").unlink()
    (data / "a.txt").symlink_to("/dev/zero")  # reading it would never end
    with pytest.raises(DataError, match="is not a regular file"):
        read_text_file(data / "a.txt")


@pytest.mark.parametrize("key", ["../private/secret.png", "/etc/passwd", "sub/../../x.png"])
def test_a_metadata_key_naming_another_folder_is_refused(folders, tmp_path, key):
    data, _ = folders
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"a": {"caption": "ok"}, key: {"caption": "x"}}))
    with pytest.raises(DataError, match="names a path outside the data folder") as e:
        scan_dataset(data, metadata=meta)
    assert str(meta) in e.value.message and repr(key) in e.value.message
    assert scan_dataset(data, metadata=meta, allow_outside=True)[0][0].caption == "ok"


def test_full_path_keys_inside_the_folder_are_fine(folders, tmp_path, monkeypatch):
    data, _ = folders
    meta = tmp_path / "meta.json"
    merge_tags(data, meta, full_path=True)  # absolute keys, as sd-scripts' --full_path writes them
    assert scan_dataset(data, metadata=meta)[0][0].caption == "a cat"
    monkeypatch.chdir(tmp_path / "private")  # a key relative to the working directory, with ..
    meta.write_text(json.dumps({"../data/a.png": {"caption": "relative"}}))
    assert scan_dataset(Path("../data"), metadata=meta)[0][0].caption == "relative"


def test_videos_txt_lines_outside_the_folder(folders):
    data, outside = folders
    (data / "prompt.txt").write_text("one\ntwo\n")
    (data / "videos.txt").write_text(f"a.png\n{outside / 'secret.png'}\n")
    with pytest.raises(DataError, match=r"videos\.txt line 2: '.*secret\.png' leads outside the data folder"):
        scan_videos(data)
    (data / "videos.txt").write_text("a.png\n../private/secret.png\n")
    with pytest.raises(DataError, match=r"line 2: '\.\./private/secret\.png' leads outside"):
        scan_videos(data)
    records, skipped = scan_videos(data, allow_outside=True)
    assert [r.caption for r in records] == ["one", "two"] and not skipped


def test_video_folder_layout_links(folders):
    data, outside = folders
    (data / "a.txt").symlink_to(outside / "id_rsa")
    with pytest.raises(DataError, match="outside the data folder"):
        scan_videos(data)
    assert scan_videos(data, allow_outside=True)[0][0].caption.startswith("-----BEGIN")


def test_a_metadata_path_that_is_a_device_is_refused():
    from difftrain.data.tags import load_metadata

    with pytest.raises(DataError, match="metadata file /dev/zero is not a regular file"):
        load_metadata(Path("/dev/zero"))
