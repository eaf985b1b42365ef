"""Hugging Face Hub ids wherever a model path goes (issue 25): parsed apart from local paths, found in a local HF
cache offline (the layout huggingface_hub writes, built here), written into the run's config as the snapshot,
and every failure named (not cached while offline, no such file)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from difftrain.runtime.hub import HubRef, parse_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_hub_ids_are_told_apart_from_local_paths(tmp_path, monkeypatch):
    assert parse_hub_id("stabilityai/stable-diffusion-xl-base-1.0") == HubRef(
        "stabilityai/stable-diffusion-xl-base-1.0", None, None
    )
    assert parse_hub_id("org/name@v1.0") == HubRef("org/name", None, "v1.0")
    assert parse_hub_id("org/name/sd_xl_base_1.0.safetensors@main") == HubRef(
        "org/name", "sd_xl_base_1.0.safetensors", "main"
    )
    assert parse_hub_id("org/name/sub/dir/model.safetensors") == HubRef("org/name", "sub/dir/model.safetensors", None)
    for local in ("./org/name", "/abs/model", "~/models/x", "C:/models/x", "models\\x", "model.safetensors", ""):
        assert parse_hub_id(local) is None, local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_id("org/name") is None  # a folder of that name here wins


def hub_cache(root: Path, repo: str, files: dict[str, Path]) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snap = folder / "snapshots" / COMMIT
    for rel, src in files.items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, snap / rel)
        else:
            shutil.copy(src, snap / rel)
    return snap


def _env(cache: Path) -> dict:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


@pytest.mark.slow
def test_train_with_a_hub_id_from_the_local_cache_offline(tiny_model, dataset, tmp_path):
    from conftest import set_args

    cache = tmp_path / "hf"
    snap = hub_cache(cache, "tiny-org/tiny-sdxl", {p.name: p for p in tiny_model.iterdir()})
    script = str(Path(sys.executable).parent / "difftrain")
    sets = [
        f"data.dir={dataset}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=2",
    ]
    r = subprocess.run(
        [script, "train", "--recipe", "tiny-sdxl-lora", "--model", "tiny-org/tiny-sdxl", *set_args(sets)],
        capture_output=True,
        text=True,
        env=_env(cache),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"snapshot {COMMIT}" in " ".join(r.stderr.split())
    import yaml

    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert Path(saved["model"]["path"]) == snap  # the run names the exact weights it trained from
    assert (tmp_path / "run" / "pytorch_lora_weights.safetensors").exists()


def test_hub_failures_are_named(tmp_path):
    script = str(Path(sys.executable).parent / "difftrain")
    cache = tmp_path / "hf"
    cache.mkdir()
    r = subprocess.run(
        [script, "precompute", "--recipe", "tiny-sdxl-lora", "--model", "nobody/nothing", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_env(cache),
    )
    text = " ".join(r.stderr.split())
    assert r.returncode == 1 and "nobody/nothing is not in the local Hugging Face cache and HF_HUB_OFFLINE" in text
    assert "hf download nobody/nothing" in text and "Traceback" not in r.stderr


def test_a_single_file_in_a_repo_resolves_to_that_file(tmp_path):
    cache = tmp_path / "hf"
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    snap = hub_cache(cache, "org/single", {"sd_xl_base_1.0.safetensors": f})
    code = (
        "from difftrain.runtime.hub import resolve_model_path; "
        "print(resolve_model_path('org/single/sd_xl_base_1.0.safetensors', ['unet'])[0])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(cache))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == snap / "sd_xl_base_1.0.safetensors"
    code = (
        "from difftrain.runtime.hub import resolve_model_path; resolve_model_path('org/single/other.safetensors', [])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(cache))
    assert r.returncode != 0 and "not in the local Hugging Face cache" in r.stderr


def test_the_library_path_resolves_a_hub_id_too(tiny_model, tmp_path):
    """A sweep's trials and library callers reach the family loader with the id itself: it resolves there."""
    cache = tmp_path / "hf"
    snap = hub_cache(cache, "tiny-org/tiny-sdxl", {p.name: p for p in tiny_model.iterdir()})
    code = (
        "from difftrain.families.sdxl import SDXL; from difftrain.config.schema import ModelConfig; "
        "print(SDXL()._source(ModelConfig(path='tiny-org/tiny-sdxl')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(cache))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(("diffusers", snap))


@pytest.mark.parametrize(
    ("error", "words", "hint"),
    [
        ("GatedRepoError", "is a gated model: its licence must be accepted", "hf auth login"),
        ("RepositoryNotFoundError", "No model org/name on the Hugging Face Hub (or it is private)", "org/name"),
        ("RevisionNotFoundError", "has no revision 'v9'", "branch, tag or commit"),
        ("EntryNotFoundError", "has no file", "model page"),
    ],
)
def test_each_hub_refusal_names_the_next_step(monkeypatch, error, words, hint):
    """What the Hub answers online (gated, no such repo, no such revision or file) becomes a message with the next
    step; huggingface_hub's download is replaced by one raising that error (no network here)."""
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    from difftrain.errors import ModelLoadError
    from difftrain.runtime.hub import fetch, parse_hub_id

    cls = getattr(hub_errors, error)

    def refuse(*args, **kwargs):
        err = cls.__new__(cls)  # without the HTTP response its constructor wants
        Exception.__init__(err, error)
        raise err

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    ref = parse_hub_id("org/name@v9" if error == "RevisionNotFoundError" else "org/name")
    if error == "EntryNotFoundError":
        ref = parse_hub_id("org/name/unet.safetensors")
    assert ref is not None
    with pytest.raises(ModelLoadError) as got:
        fetch(ref, ["unet"])
    assert words in str(got.value) and hint in got.value.hint
