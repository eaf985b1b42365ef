"""Untrusted binary files through the CLI: crafted .safetensors models (single file or in a diffusers folder), LoRA
files, cache shards and checkpoints, pickles, and cache manifests and indexes that point elsewhere or hold wrong
types. Each gives difftrain's own message naming the file, exit code != 0, no traceback; no pickled code runs."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import clean_failure as _clean_failure
from conftest import set_args as _sets
from conftest import tiny_sets


# ----------------------------------------------------------------- checkpoints and LoRA files
def _st(header: dict, data: bytes = b"\0" * 16) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


CRAFTED = {
    "header of 2^60 bytes": ((2**60).to_bytes(8, "little") + b"{}", "claims a 1152921504606846976-byte header"),
    "header longer than the file": ((50).to_bytes(8, "little") + b"{}", "claims a 50-byte header"),
    "header not JSON": ((4).to_bytes(8, "little") + b"\xff\xfe{}", "unreadable safetensors header"),
    "offsets beyond the file": (
        _st({"a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}),
        "not fully covered",
    ),
    "unknown dtype": (_st({"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}}), "unknown variant `Q7`"),
    "zero bytes": (b"", "too short to be a safetensors file"),
}

# a checkpoint is read by difftrain's SafetensorsReader (plain reads, no mapping), which words these two itself
READER = {
    "offsets beyond the file": "tensor 'a' lies beyond the end of the file",
    "unknown dtype": "tensor 'a' has an invalid dtype, shape or offsets",
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_single_file_checkpoint(cli, dataset, tmp_path, case):
    raw, needle = CRAFTED[case][0], READER.get(case, CRAFTED[case][1])
    f = tmp_path / "model.safetensors"
    f.write_bytes(raw)
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", *_sets(tiny_sets(f, dataset, tmp_path)))
    _clean_failure(r, 1, f"{f} is not a readable safetensors file", needle)


@pytest.mark.parametrize("case", ["header of 2^60 bytes", "offsets beyond the file"])
def test_a_crafted_file_in_a_diffusers_folder(cli, tiny_model, dataset, tmp_path, case):
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    bad = model / "text_encoder" / "model.safetensors"
    bad.write_bytes(CRAFTED[case][0])
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", *_sets(tiny_sets(model, dataset, tmp_path)))
    _clean_failure(r, 1, f"{bad} is not a readable safetensors file", READER.get(case, CRAFTED[case][1]))


class _Boom:
    def __reduce__(self):
        import os

        return os.system, (f"touch {_Boom.marker}",)


def test_pickle_code_never_runs_even_with_allow_pickle(cli, dataset, tmp_path):
    _Boom.marker = tmp_path / "pwned"
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(pickle.dumps({"state_dict": _Boom()}))
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", "--allow-pickle", *_sets(tiny_sets(ckpt, dataset, tmp_path)))
    _clean_failure(r, 1, "cannot be read as a torch checkpoint with weights_only=True")
    assert not _Boom.marker.exists()


def test_a_diffusers_folder_of_pickles_needs_allow_pickle(cli, tiny_model, dataset, tmp_path):
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    (model / "vae" / "diffusion_pytorch_model.safetensors").rename(model / "vae" / "diffusion_pytorch_model.bin")
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", *_sets(tiny_sets(model, dataset, tmp_path)))
    _clean_failure(r, 2, f"{model / 'vae'} holds its weights as pickle (diffusion_pytorch_model.bin)", "--allow-pickle")


@pytest.fixture(scope="module")
def cached(tiny_model, _dataset_master, tmp_path_factory):
    """A precomputed cache of the tiny dataset (shared: tests copy it before damaging it)."""
    from difftrain.cli.app import main

    out = tmp_path_factory.mktemp("cached")
    with pytest.raises(SystemExit) as e:
        main(["precompute", "--recipe", "tiny-sdxl-lora", *_sets(tiny_sets(tiny_model, _dataset_master, out))])
    assert e.value.code == 0
    return out / "cache"


def _train(cli, tiny_model, data, cache, tmp_path, *extra, **sets):
    s = tiny_sets(tiny_model, data, tmp_path, **{"data.cache_dir": cache, "train.max_steps": 1, **sets})
    return cli("train", "--recipe", "tiny-sdxl-lora", "--no-precompute", *_sets(s), *extra)  # the cache as it is


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_lora_init_file(cli, tiny_model, _dataset_master, cached, tmp_path, case):
    raw, needle = CRAFTED[case]
    f = tmp_path / "init.safetensors"
    f.write_bytes(raw)
    r = _train(cli, tiny_model, _dataset_master, cached, tmp_path, **{"lora.init_weights": f})
    _clean_failure(r, 1, f"lora.init_weights {f} cannot be read", needle)


def test_a_lora_file_of_integers_or_with_a_bad_alpha(cli, tiny_model, _dataset_master, cached, tmp_path):
    import torch
    from safetensors.torch import save_file

    f = tmp_path / "ints.safetensors"
    save_file({"unet.x.lora_A.weight": torch.zeros(4, 4, dtype=torch.int32)}, f)
    _clean_failure(
        _train(cli, tiny_model, _dataset_master, cached, tmp_path, **{"lora.init_weights": f}),
        1,
        "is torch.int32, not a LoRA weight",
    )
    # a kohya file whose alpha is not a scalar
    save_file(
        {
            "lora_unet_input_blocks_0_0.lora_down.weight": torch.zeros(4, 4),
            "lora_unet_input_blocks_0_0.alpha": torch.zeros(3),
        },
        f,
    )
    _clean_failure(
        _train(cli, tiny_model, _dataset_master, cached, tmp_path, **{"lora.init_weights": f}),
        1,
        "has a malformed alpha or lora_adapter_metadata",
    )
    # a diffusers file whose metadata gives an alpha that is not a number
    save_file(
        {"unet.conv_in.lora_A.weight": torch.zeros(4, 4)},
        f,
        metadata={"lora_adapter_metadata": '{"unet.lora_alpha": "x"}'},
    )
    _clean_failure(
        _train(cli, tiny_model, _dataset_master, cached, tmp_path, **{"lora.init_weights": f}),
        1,
        "has a malformed alpha or lora_adapter_metadata",
    )


def _copy_cache(cached, tmp_path):
    return Path(shutil.copytree(cached, tmp_path / "cache-copy"))


@pytest.mark.parametrize("case", ["header of 2^60 bytes", "offsets beyond the file", "zero bytes"])
def test_a_crafted_cache_shard(cli, tiny_model, _dataset_master, cached, tmp_path, case):
    cache = _copy_cache(cached, tmp_path)
    for shard in (cache / "shards").rglob("*.safetensors"):
        shard.write_bytes(CRAFTED[case][0])
    r = _train(cli, tiny_model, _dataset_master, cache, tmp_path)
    _clean_failure(r, 1, "The cache shard", "cannot be read", CRAFTED[case][1], "difftrain precompute")


def test_cache_shard_names_cannot_leave_the_cache_folder(cli, tiny_model, _dataset_master, cached, tmp_path):
    cache = _copy_cache(cached, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["shards"]["../../victim.txt"] = 7  # an unused shard: prune would delete it
    (cache / "manifest.json").write_text(json.dumps(manifest))
    r = cli("cache", "prune", cache)
    _clean_failure(r, 1, "manifest.json is damaged or was not written by difftrain", "'../../victim.txt'")
    assert victim.read_text() == "keep me"
    del manifest["shards"]["../../victim.txt"]
    key = next(iter(manifest["entries"]))
    manifest["entries"][key]["shard"] = str(victim)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    _clean_failure(
        _train(cli, tiny_model, _dataset_master, cache, tmp_path), 1, "is not {shard: shards/xx/<id>.safetensors"
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda index: index.update(items={"a": 1}),
        lambda index: index["items"][0].update(bucket="64x64"),
        lambda index: index["items"][0].update(texts=["x"]),
        lambda index: index["items"][0].update(latent=None),
        lambda index: index["items"].__setitem__(0, "item"),
    ],
)
def test_an_index_of_wrong_types(cli, tiny_model, _dataset_master, cached, tmp_path, change):
    cache = _copy_cache(cached, tmp_path)
    index = json.loads((cache / "index.json").read_text())
    change(index)
    (cache / "index.json").write_text(json.dumps(index))
    r = _train(cli, tiny_model, _dataset_master, cache, tmp_path)
    _clean_failure(r, 1, "index.json is damaged or was not written by difftrain")
    _clean_failure(cli("cache", "info", cache), 1, "index.json is damaged")


@pytest.mark.parametrize("case", ["header of 2^60 bytes", "unknown dtype"])
def test_a_crafted_checkpoint_to_resume_from(cli, tiny_model, _dataset_master, cached, tmp_path, case):
    r = _train(cli, tiny_model, _dataset_master, cached, tmp_path, **{"train.checkpoint_every": 1})
    assert r.code == 0, r
    ckpt = Path(shutil.copytree(next((tmp_path / "run" / "checkpoints").iterdir()), tmp_path / "ckpt"))
    for f in ckpt.glob("*.safetensors"):
        f.write_bytes(CRAFTED[case][0])
    r = _train(cli, tiny_model, _dataset_master, cached, tmp_path / "again", "--resume", ckpt, **{"train.max_steps": 2})
    _clean_failure(r, 1, f"The checkpoint {ckpt} is incomplete or damaged", CRAFTED[case][1])


@pytest.mark.parametrize(
    "damage",
    [
        lambda ck: (ck / "trainer_state.json").write_text("[]"),
        lambda ck: (ck / "trainer_state.json").write_text('{"step": "1", "epoch": 0, "batch_pos": 0}'),
        lambda ck: (ck / "trainer_state.json").write_bytes(b"\xff"),
        lambda ck: (ck / "rng.json").write_text('{"__dict__": {"python": 5}}'),
        lambda ck: (ck / "trainable.json").write_text('{"__dict__": {"unet.x": {"__tensor__": "nope"}}}'),
        lambda ck: (ck / "schedule.json").write_text("[" * 100_000 + "]" * 100_000),
    ],
    ids=[
        "state a list",
        "step a string",
        "state not UTF-8",
        "rng of wrong types",
        "tensor not in the file",
        "too deep",
    ],
)
def test_a_checkpoint_with_wrong_types_to_resume_from(cli, tiny_model, _dataset_master, cached, tmp_path, damage):
    r = _train(cli, tiny_model, _dataset_master, cached, tmp_path, **{"train.checkpoint_every": 1})
    assert r.code == 0, r
    ckpt = Path(shutil.copytree(next((tmp_path / "run" / "checkpoints").iterdir()), tmp_path / "ckpt"))
    damage(ckpt)
    r = _train(cli, tiny_model, _dataset_master, cached, tmp_path / "again", "--resume", ckpt, **{"train.max_steps": 2})
    _clean_failure(r, 1, f"The checkpoint {ckpt}", "earlier checkpoint")
