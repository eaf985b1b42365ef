"""Usage errors as click means them, through the real console script (issue 25): whatever click typer runs on
(typer 0.29 bundles its own copy, whose exceptions are not click's), an unknown option or command, a missing or
badly typed argument prints the usage line and the problem and exits 2, never "an unexpected ..."; --version."""

from __future__ import annotations

import subprocess

import pytest

from conftest import console_script


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([console_script(), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "usage", "problem"),
    [
        (["badcmd"], "Usage: difftrain [OPTIONS] COMMAND [ARGS]...", "No such command 'badcmd'"),
        (
            ["train", "--recipe", "tiny-sdxl-lora", "--bogus"],
            "Usage: difftrain train [OPTIONS]",
            "--bogus",
        ),
        (["merge-tags"], "Usage: difftrain merge-tags", "Missing argument"),
        (["bench", "speed", "--steps", "abc"], "Usage: difftrain bench speed", "Invalid value for '--steps'"),
        (["lora", "nothing"], "Usage: difftrain lora", "No such command 'nothing'"),
    ],
)
def test_usage_errors_show_the_usage_and_exit_2(args, usage, problem):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert usage in r.stderr and problem in r.stderr, r.stderr  # click's wording varies between releases
    assert "Error: No such" in r.stderr or "Error: Missing" in r.stderr or "Error: Invalid" in r.stderr, r.stderr
    assert "unexpected" not in r.stderr + r.stdout and "Traceback" not in r.stderr + r.stdout


def test_version():
    from difftrain import __version__

    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"difftrain {__version__} (Python ") and "torch " in r.stdout


def test_help_exits_0_and_lists_the_commands():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for command in ("train", "precompute", "merge-tags", "recipes", "bench"):
        assert command in r.stdout


def test_shell_completion_installs_the_typer_way_and_completes_commands():
    r = run("--show-completion", "bash")
    assert r.returncode == 0 and "complete -o default -F _difftrain_completion difftrain" in r.stdout, r
    import os

    env = {**os.environ, "_DIFFTRAIN_COMPLETE": "complete_bash", "COMP_WORDS": "difftrain rec", "COMP_CWORD": "1"}
    r = subprocess.run([console_script()], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["recipes"], (r.stdout, r.stderr)


@pytest.mark.slow
def test_train_alone_is_the_whole_flow_and_no_precompute_refuses(tiny_model, dataset, tmp_path):
    """One command: train on a new dataset encodes what the cache lacks first (saying so), a second run reuses it
    all; --no-precompute refuses on an empty cache with precompute's message."""
    from conftest import set_args, tiny_sets

    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"train.max_steps": 2, "train.checkpoint_every": 1000})
    r = run("train", "--recipe", "tiny-sdxl-lora", *set_args(sets))
    assert r.returncode == 0, r.stderr[-3000:]
    text = " ".join((r.stdout + r.stderr).split())
    assert "precompute: latents 8 encoded, 0 reused" in text, text[-3000:]
    assert (tmp_path / "run" / "pytorch_lora_weights.safetensors").exists()
    again = run("train", "--recipe", "tiny-sdxl-lora", *set_args(sets), "--set", f"train.output_dir={tmp_path / 'b'}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "precompute: latents 0 encoded, 8 reused" in " ".join((again.stdout + again.stderr).split())
    other = tiny_sets(tiny_model, dataset, tmp_path / "fresh", **{"train.max_steps": 2})
    refused = run("train", "--recipe", "tiny-sdxl-lora", "--no-precompute", *set_args(other))
    assert refused.returncode != 0 and "No precomputed data" in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
