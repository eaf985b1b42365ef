"""Untrusted configs through the CLI: YAML with Python tags, alias bombs, deep nesting, binary files, NaN, huge
numbers, wrong types. Each is a ConfigError naming the file (or the --set), exit code 2, no traceback."""

from __future__ import annotations

import pytest

from conftest import clean_failure as _clean_failure

# ----------------------------------------------------------------- configs
CONFIGS = {
    "python tag": ('train: !!python/object/apply:os.system ["touch {marker}"]\n', "not valid YAML"),
    "self-containing alias": ("a: &x {b: *x}\n", "nests deeper than 32 levels"),
    "billion laughs": (
        "a: &a {x: 1, y: 1, z: 1, w: 1, v: 1, u: 1, t: 1, s: 1, r: 1}\n"
        + "".join(
            f"{n}: &{n} {{{', '.join(f'{k}: *{p}' for k in 'xyzwvutsr')}}}\n" for p, n in zip("abcdefg", "bcdefgh")
        ),
        "more than 100,000 values",
    ),  # 9^8 values from a 1 KB file
    "5000 nested lists": ("train: " + "[" * 5000 + "]" * 5000 + "\n", "nests too deeply"),
    "NaN": ("train: {learning_rate: .nan}\n", "train.learning_rate: Input should be a finite number"),
    "infinity": ("flow: {logit_mean: .inf}\n", "flow.logit_mean: Input should be a finite number"),
    "huge integer": ("train: {seed: 99999999999999999999999}\n", "train.seed: 99999999999999999999999 is too large"),
    "huge resolution": (
        "data: {resolution: 1000000000, max_side: 1000000000}\n",
        "data.resolution: Input should be less than or equal to 16384",
    ),
    "wrong types and unknown keys": (
        "train: {batch_size: [1, 2], bogus: 1}\nlora: 7\n",
        "train.batch_size: Input should be a valid integer",
    ),
    "a list": ("- just\n- a list\n", "must be a mapping of sections"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_hostile_config_file_is_a_config_error_naming_the_file(cli, tmp_path, case):
    text, needle = CONFIGS[case]
    marker = tmp_path / "pwned"
    f = tmp_path / "user config.yaml"
    f.write_text(text.replace("{marker}", str(marker)), encoding="utf-8")
    r = cli("train", "--recipe", "tiny-sdxl-lora", "--config", f, "--print-config")
    _clean_failure(r, 2, needle, f)
    assert not marker.exists()  # the Python tag was never constructed


def test_a_binary_config_file_or_recipe_is_a_config_error(cli, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"\x80\x81\xfe binary")
    _clean_failure(cli("train", "--config", f, "--print-config"), 2, f"{f} is not UTF-8 text")
    _clean_failure(cli("train", "--recipe", f, "--print-config"), 2, f"{f} is not UTF-8 text")


@pytest.mark.parametrize(
    "item, needle",
    [
        ("train.learning_rate=.nan", "Input should be a finite number (from --set train.learning_rate)"),
        ("train.max_steps=1e400", "train.max_steps: Input should be a valid integer"),
        ("train.epochs=123456789012345678901234567890", "too large"),
        ("lora.rank={a: &x {b: *x}}", "value of --set lora.rank nests deeper"),
        ("lora.rank=" + "[" * 3000, "lora.rank: Input should be a valid integer"),  # not YAML: kept as text
        ("memory.weights.kind=!!python/object:os.system", "memory.weights"),
    ],
    ids=["nan", "1e400", "huge int", "alias loop", "3000 brackets", "python tag"],
)
def test_hostile_set_values(cli, item, needle):
    _clean_failure(cli("train", "--recipe", "tiny-sdxl-lora", "--set", item, "--print-config"), 2, needle)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("recipe: tiny-sdxl-lora\ngrid: [lora.rank, 4]\n", "grid must be a mapping of path: [values]"),
        ("recipe: tiny-sdxl-lora\nrandom: {trials: '3'}\n", "random must be {trials: N"),
        ("recipe: tiny-sdxl-lora\nrandom: {trials: 2, seed: x}\n", "random must be {trials: N"),
        ("config: 5\n", "config must be a file path"),
        ("recipe: tiny-sdxl-lora\nset: just text\n", "set must be a mapping"),
    ],
    ids=["grid a list", "trials a string", "seed a string", "config a number", "set a string"],
)
def test_a_sweep_file_of_wrong_types(cli, tmp_path, text, needle):
    f = tmp_path / "sweep.yaml"
    f.write_text(text)
    _clean_failure(cli("sweep", "--spec", f, "-o", tmp_path / "out"), 2, f"The sweep file {f}", needle)
    assert not (tmp_path / "out").exists()


def test_sd_scripts_inputs_that_are_not_text_or_hold_markup(cli, tmp_path):
    toml = tmp_path / "config.toml"
    toml.write_bytes(b"\xff\xfe binary")
    _clean_failure(
        cli("convert-args", "--", "sdxl_train_network.py", f"--config_file={toml}"), 2, f"{toml} is not valid TOML"
    )
    _clean_failure(
        cli("convert-args", "--", "sdxl_train_network.py", "--config_file"), 2, "--config_file needs a TOML file path"
    )
    r = cli("convert-args", "--", "sdxl_train_network.py", "--lr_warmup_steps=1e400", "--bogus=[/x] [bold]y")
    assert r.code == 0, r
    assert "--bogus=[/x] [bold]y" in r.err and "--lr_warmup_steps=1e400" in r.err  # listed as not mapped, as written


def test_a_host_allocation_that_fails_is_reported_as_out_of_memory(capsys):
    """What a huge (valid) lora.rank or batch size ends in on the CPU: torch's allocator refuses the request."""
    from difftrain.cli.app import report_error

    e = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 144000000000 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert report_error(e) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "error: out of memory:" in err and "an unexpected" not in err and "lora.rank" in err


def test_a_full_disk_is_said_as_such_with_what_to_do(capsys, tmp_path):
    """A write that finds the disk full (a random model's files filled a benchmark machine's disk) is not "an
    unexpected OSError": it names the file and says what to do."""
    import errno

    from difftrain.cli.app import report_error

    where = tmp_path / "cache" / "shard-0001.safetensors"
    assert report_error(OSError(errno.ENOSPC, "No space left on device", str(where))) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "the disk is full writing" in err and str(where) in err and "an unexpected" not in err
    assert "another disk" in err
    # another OSError stays an unexpected one (with the debug hint)
    assert report_error(OSError(errno.EACCES, "Permission denied", str(where))) == 1
    assert "an unexpected PermissionError" in " ".join(capsys.readouterr().err.split())
