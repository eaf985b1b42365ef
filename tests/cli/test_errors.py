"""Bad input gets a clear message, the right exit code and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import tiny_sets


def _no_traceback(r):
    assert "Traceback" not in r.err and "Traceback" not in r.out


def _sets(sets):
    return [a for s in sets for a in ("--set", s)]


def test_unknown_recipe(cli):
    r = cli("train", "--recipe", "sdxl-lora-8gib")
    assert r.code == 2
    assert "no recipe named 'sdxl-lora-8gib'" in r.err and "sdxl-lora-8gb" in r.err  # suggests the close match
    _no_traceback(r)


def test_unknown_config_key_and_negative_lr_are_all_listed(cli, tmp_path):
    r = cli(
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        "--set",
        "train.learning_rte=1e-4",
        "--set",
        "train.learning_rate=-1",
        "--set",
        "memory.weights.kind=fp9",
    )
    assert r.code == 2
    assert "3 problems" in r.err
    assert "train.learning_rte: unknown key" in r.err
    assert "train.learning_rate: Input should be greater than 0" in r.err
    assert "memory.weights" in r.err and "fp9" in r.err
    _no_traceback(r)


def test_impossible_combination_names_both_options(cli):
    r = cli(
        "train", "--recipe", "tiny-sdxl-lora", "--set", "train.warmup_steps=10", "--set", "train.lr_scheduler=constant"
    )
    assert r.code == 2
    assert "warmup_steps" in r.err and "constant_with_warmup" in r.err
    _no_traceback(r)


def test_keep_on_gpu_without_offload_is_refused_through_the_console_script():
    from conftest import script_train

    r = script_train("--recipe", "tiny-wan-lora", "--set", "memory.activations={kind: checkpoint, keep_on_gpu: 4}")
    assert r.code == 2, (r.out, r.err)
    assert "memory.activations" in r.err and "keep_on_gpu" in r.err and "offload: true" in r.err, r.err
    _no_traceback(r)


def test_save_attention_beside_offloaded_checkpoints_is_refused_through_the_console_script():
    """memory.activations.save_attention keeps the attentions' outputs of torch's checkpoint; the offloaded and split
    checkpoints are difftrain's own, which it cannot take."""
    from conftest import script_train

    sets = "memory.activations={kind: checkpoint, offload: true, save_attention: true}"
    r = script_train("--recipe", "tiny-wan-lora", "--set", sets)
    assert r.code == 2, (r.out, r.err)
    assert "save_attention" in r.err and "offload and split to false" in r.err, r.err
    _no_traceback(r)


def test_missing_model_path(cli, dataset, tmp_path):
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", *_sets(tiny_sets(tmp_path / "nope", dataset, tmp_path)))
    assert r.code == 1
    assert f"The model path {tmp_path / 'nope'} does not exist" in r.err.replace("\n", "")
    assert "next:" in r.err
    _no_traceback(r)


def test_corrupt_only_image_fails_cleanly(cli, tiny_model, tmp_path):
    data = tmp_path / "bad"
    data.mkdir()
    (data / "a.png").write_bytes(b"not a png at all")
    (data / "a.caption").write_text("x")
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", *_sets(tiny_sets(tiny_model, data, tmp_path)))
    assert r.code == 1
    assert "No usable images" in r.err and "a.png" in r.err
    _no_traceback(r)


def test_train_before_precompute_says_what_to_run(cli, tiny_model, dataset, tmp_path):
    """With --no-precompute (without it, train encodes the cache itself)."""
    r = cli("train", "--recipe", "tiny-sdxl-lora", "--no-precompute", *_sets(tiny_sets(tiny_model, dataset, tmp_path)))
    assert r.code == 1 and "difftrain precompute" in r.err
    _no_traceback(r)


def test_pickle_checkpoint_refused_without_flag(cli, dataset, tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"\x80\x04K\x01.")  # never unpickled
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", *_sets(tiny_sets(ckpt, dataset, tmp_path)))
    assert r.code == 2 and "pickle" in r.err and "--allow-pickle" in r.err
    _no_traceback(r)


@pytest.mark.slow
def test_debug_env_shows_traceback_and_console_script_exit_code(tmp_path):
    env = dict(os.environ, DIFFTRAIN_DEBUG="1")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "difftrain",
            "train",
            "--recipe",
            "tiny-sdxl-lora",
            "--set",
            f"model.path={tmp_path / 'missing'}",
            "--set",
            f"data.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 1
    assert "Traceback" in p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "difftrain", "recipes", "show", "nope"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
