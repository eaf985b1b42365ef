"""File names with spaces, Unicode, shell and markup characters go through merge-tags, precompute and training."""

from __future__ import annotations

import json

from conftest import tiny_sets

ODD = ["猫 café", "$(rm -rf x);'\"&|", "-rf --help", "line\nbreak", "[bold] :fire: 100%"]


def test_odd_file_names_merge_precompute_and_train(cli, tiny_model, dataset, tmp_path, monkeypatch):
    sentinel = tmp_path / "x"
    sentinel.mkdir()
    monkeypatch.chdir(tmp_path)  # where `rm -rf x` would strike if a name ever reached a shell
    stems = sorted(p.stem for p in dataset.glob("*.png"))
    for old, new in zip(stems, ODD):
        for f in dataset.glob(f"{old}.*"):
            f.rename(dataset / f"{new}{f.suffix}")
    (dataset / f"{ODD[0]}.caption").write_text("un chat 猫 sur un café", encoding="utf-8")

    meta = tmp_path / "méta data.json"
    r = cli("merge-tags", dataset, meta)
    assert r.code == 0, r
    entries = json.loads(meta.read_text(encoding="utf-8"))
    assert set(ODD) <= set(entries) and len(entries) == 8
    assert entries[ODD[0]]["caption"] == "un chat 猫 sur un café"

    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"data.metadata": meta, "train.max_steps": 2})
    args = [a for s in sets for a in ("--set", s)]
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", "--strict", *args)
    assert r.code == 0, r
    index = json.loads((tmp_path / "cache" / "index.json").read_text(encoding="utf-8"))
    by_key = {it["key"]: it for it in index["items"]}
    assert set(ODD) <= set(by_key) and by_key[ODD[0]]["caption"] == "un chat 猫 sur un café"

    r = cli("train", "--recipe", "tiny-sdxl-lora", *args)
    assert r.code == 0, r
    assert (tmp_path / "run" / "pytorch_lora_weights.safetensors").stat().st_size > 0
    assert sentinel.is_dir() and all((dataset / f"{n}.png").is_file() for n in ODD)
