"""Config layers: defaults < recipe < file < --set, validated once, with sources."""

from __future__ import annotations

import pytest

from difftrain.config.load import parse_set, resolve
from difftrain.errors import ConfigError, UsageError


def test_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train: {learning_rate: 0.25, batch_size: 3}\nlora: {rank: 7}\n")
    res = resolve(recipe="tiny-sdxl-lora", config_file=f, sets=["lora.rank=9"])
    c = res.config
    assert c.train.learning_rate == 0.25 and c.train.batch_size == 3  # file over recipe
    assert c.lora.rank == 9  # --set over file
    assert c.data.resolution == 128  # recipe over default
    assert c.train.noise_offset == 0.0  # default
    src = {k: s for k, _, s in res.rows()}
    assert src["lora.rank"] == "--set lora.rank" and src["train.batch_size"] == f"file {f}"
    assert src["data.resolution"] == "recipe tiny-sdxl-lora" and src["train.seed"].startswith("recipe")


def test_tagged_union_kind_change_replaces_the_option():
    c = resolve(recipe="sdxl-lora-8gb", sets=["memory.weights={kind: fp32}", "memory.activations.kind=none"]).config
    assert c.memory.weights.kind == "fp32" and c.memory.activations.kind == "none"


def test_set_values_are_typed():
    assert parse_set("a.b=3") == (["a", "b"], 3)
    assert parse_set("a=[x, y]") == (["a"], ["x", "y"])
    # YAML 1.1 would read these as booleans; kept as strings so train.mixed_precision=no works
    # (pydantic still accepts "yes"/"no" for a bool field)
    assert parse_set("train.mixed_precision=no") == (["train", "mixed_precision"], "no")
    assert (
        resolve(
            sets=["train.mixed_precision=no", "memory.weights.kind=fp32", "data.no_upscale=yes"]
        ).config.data.no_upscale
        is True
    )
    with pytest.raises(UsageError):
        parse_set("novalue")


def test_every_problem_listed_with_its_path():
    with pytest.raises(ConfigError) as e:
        resolve(sets=["train.batch_size=0", "data.resolution=hello", "bogus.key=1"])
    paths = [p for p, _ in e.value.problems]
    assert set(paths) == {"data.resolution", "train.batch_size", "bogus"}
    assert e.value.exit_code == 2


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve(config_file=f)
