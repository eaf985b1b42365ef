"""Fuzzing the parsers of user files: for any input they succeed or raise difftrain's own error, never another.

Covered: the config loader (``resolve`` over ``--set`` items and YAML files, ``parse_set``, ``read_yaml``), the
merge-tags metadata reader (``load_metadata``, ``MetadataIndex``, ``scan_dataset`` with a metadata file), the
caption and tag parsers (``parse_tag_file``, ``normalize_tags``, ``apply_rules``, ``TagRules``, ``read_text_file``,
``sidecar_texts``, ``augment_caption``, ``caption_variants``), cogvideox-factory's prompt.txt / videos.txt, sweep
files and sd-scripts command lines. Each test is bounded (``max_examples``) so the file
runs in well under a minute on two CPU cores.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from difftrain.config.load import parse_set, read_yaml, resolve
from difftrain.config.schema import Config
from difftrain.data.captions import CaptionAugment, augment_caption, caption_variants
from difftrain.data.paths import read_text_file
from difftrain.data.sources import MetadataIndex, caption_for, scan_dataset, sidecar_texts
from difftrain.data.tags import TagRules, apply_rules, load_metadata, normalize_tags, parse_tag_file
from difftrain.data.video import scan_videos
from difftrain.errors import DifftrainError

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))

# dotted keys the schema has (and some it has not), so values reach the real validators
_SECTIONS = {
    name: list(f.annotation.model_fields) if hasattr(f.annotation, "model_fields") else []
    for name, f in Config.model_fields.items()
}
_KEYS = sorted(
    list(_SECTIONS)
    + [f"{s}.{k}" for s, ks in _SECTIONS.items() for k in ks]
    + ["memory.weights.kind", "memory.optimizer.kind", "memory.engine.stage", "bogus", "train.bogus.x"]
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_json = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)
_values = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "1e400",
            "-1e400",
            ".nan",
            ".inf",
            "nan",
            "[[[[",
            "{a: [1, {b: }",
            "!!python/object:os.system",
            "&a [*a]",
            "*x",
            "99999999999999999999999",
            "-0",
            "0x10",
            "{kind: nf4}",
            "[1, 2]",
            "null",
            "~",
            "yes",
            "''",
        ]
    ),
)


def _ok_or_difftrain(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except DifftrainError as e:
        assert e.message  # a sentence, never empty
        return None


# ----------------------------------------------------------------- the config loader
@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_KEYS) | st.text(max_size=12), _values | _json.map(json.dumps)), max_size=4))
def test_set_items_give_a_config_or_a_config_error(items):
    sets = [f"{k}={v}" for k, v in items]
    _ok_or_difftrain(resolve, recipe="tiny-sdxl-lora", sets=sets)


@FUZZ
@given(st.text(max_size=60))
def test_parse_set_never_crashes(item):
    _ok_or_difftrain(parse_set, item)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(list(_SECTIONS) + ["bogus"]),
        _json
        | st.dictionaries(st.sampled_from(sorted({k for ks in _SECTIONS.values() for k in ks})), _json, max_size=5),
        max_size=4,
    )
)
def test_yaml_config_files_of_any_structure(data):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "c.yaml"
        f.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        _ok_or_difftrain(resolve, config_file=f)


@pytest.mark.slow
@FUZZ
@given(
    st.text(max_size=200)
    | st.sampled_from(
        [
            "a: !!python/object/apply:os.system ['true']",
            "a: &x [*x]",
            "[" * 2000,
            "{" * 2000,
            "a: b: c",
            "x: &a {b: 1}\ny: {<<: *a}",
            "%YAML 9.9\n---\na: 1",
            "\t- x",
        ]
    )
)
def test_yaml_text_of_a_user_file(text):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "c.yaml"
        f.write_text(text, encoding="utf-8")
        _ok_or_difftrain(read_yaml, f)
        _ok_or_difftrain(resolve, config_file=f)


@FEW
@given(st.binary(max_size=200))
def test_binary_config_files(data):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "c.yaml"
        f.write_bytes(data)
        _ok_or_difftrain(resolve, config_file=f)


# ----------------------------------------------------------------- merge-tags metadata
@FUZZ
@given(_json)
def test_metadata_json_of_any_shape(obj):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "meta.json"
        f.write_text(json.dumps(obj), encoding="utf-8")
        meta = _ok_or_difftrain(load_metadata, f)
        if meta is not None:
            index = MetadataIndex(meta, f)
            for key in list(meta)[:5]:
                _ok_or_difftrain(index.texts, Path(key) if key else Path("x.png"))


@FEW
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "a.png", "/abs/a.png", "../a.png", "sub/../a.png", ""]), _json, max_size=4
    )
    | st.binary(max_size=80).map(lambda b: b.decode("latin-1"))
    | _json
)
def test_scan_with_any_metadata_file(meta):
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "data"
        data.mkdir()
        Image.new("RGB", (8, 8)).save(data / "a.png")
        Image.new("RGB", (8, 8)).save(data / "b.png")
        m = Path(d) / "meta.json"
        m.write_text(meta if isinstance(meta, str) else json.dumps(meta), encoding="utf-8")
        _ok_or_difftrain(scan_dataset, data, metadata=m)


@FEW
@given(st.binary(max_size=120))
def test_metadata_bytes(data):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "meta.json"
        f.write_bytes(data)
        _ok_or_difftrain(load_metadata, f)


def test_deeply_nested_metadata_is_a_data_error(tmp_path):
    f = tmp_path / "meta.json"
    f.write_text("[" * 100_000 + "]" * 100_000)
    assert _ok_or_difftrain(load_metadata, f) is None


# ----------------------------------------------------------------- captions and tags
_tag_text = st.text(max_size=120) | st.lists(
    st.tuples(st.text(max_size=10), st.floats(-2, 2) | st.sampled_from(["x", "", "1e999", "nan"])), max_size=6
).map(lambda rows: "tag,confidence\n" + "\n".join(f"{t},{v}" for t, v in rows))


@FUZZ
@given(
    _tag_text,
    st.lists(st.text(max_size=8), max_size=3),
    st.none() | st.floats(allow_nan=True),
    st.booleans(),
    st.booleans(),
    st.text(max_size=6),
    st.sampled_from([None, "tags", "caption", "both", "bogus"]),
)
def test_tag_files_and_rules(text, drop, threshold, dedupe, underscores, ratings, caption_from):
    pairs = parse_tag_file(text)
    assert all(isinstance(t, str) for t, _ in pairs)
    assert isinstance(normalize_tags(text), str)
    rules = _ok_or_difftrain(
        TagRules,
        drop=frozenset(drop),
        dedupe=dedupe,
        threshold=threshold,
        underscores=underscores,
        ratings=ratings,
        caption_from=caption_from,
    )
    if rules is not None:
        assert all(isinstance(t, str) for t in apply_rules(pairs, rules))


@FEW
@given(st.binary(max_size=120) | st.text(max_size=120).map(lambda t: t.encode("utf-8")))
def test_caption_and_tag_files_of_any_bytes(data):
    with tempfile.TemporaryDirectory() as d:
        img = Path(d) / "a.png"
        Image.new("RGB", (8, 8)).save(img)
        img.with_suffix(".caption").write_bytes(data)
        img.with_suffix(".txt").write_bytes(data[::-1])
        _ok_or_difftrain(read_text_file, img.with_suffix(".caption"))
        _ok_or_difftrain(sidecar_texts, img)
        for source in ("caption_then_tags", "caption_and_tags", "tags"):
            result = _ok_or_difftrain(scan_dataset, Path(d), caption_source=source)
            assert result is None or isinstance(result[0][0].caption, str)


@FEW
@given(st.lists(st.text(max_size=30), max_size=4), st.lists(st.text(max_size=30), max_size=4))
def test_cogvideox_factory_prompt_and_video_lists(prompts, videos):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "prompt.txt").write_text("\n".join(prompts), encoding="utf-8")
        (Path(d) / "videos.txt").write_text("\n".join(videos), encoding="utf-8")
        _ok_or_difftrain(scan_videos, Path(d))


@FUZZ
@given(
    st.text(max_size=80),
    st.text(max_size=80) | st.none(),
    st.sampled_from(["caption_then_tags", "caption_and_tags", "tags"]),
    st.dictionaries(
        st.sampled_from(
            [
                "shuffle_caption",
                "keep_tokens",
                "keep_tokens_separator",
                "caption_separator",
                "caption_tag_dropout_rate",
                "caption_variants",
            ]
        ),
        _scalars,
        max_size=4,
    ),
)
def test_caption_augmentation(caption, tags, source, data):
    cfg = _ok_or_difftrain(resolve, sets=[f"data.{k}={json.dumps(v)}" for k, v in data.items()])
    text = caption_for(caption, tags, source)
    if cfg is not None:
        aug = CaptionAugment.from_config(cfg.config.data)
        assert isinstance(augment_caption(text, aug, random.Random(0)), str)
        assert 1 <= len(caption_variants(text, aug)) <= aug.variants or not text


# ----------------------------------------------------------------- sweep specs and sd-scripts options (configs too)
@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["recipe", "config", "set", "grid", "random", "bogus"]),
        _json
        | st.dictionaries(
            st.sampled_from(["trials", "seed", "axes", "lora.rank", "train.seed"]),
            _json | st.dictionaries(st.text(max_size=8), _json, max_size=3),
            max_size=3,
        ),
        max_size=4,
    )
)
def test_sweep_files_of_any_structure(data):
    from difftrain.flows.sweep import expand, load_spec

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "sweep.yaml"
        f.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        spec = _ok_or_difftrain(load_spec, f)
        if spec is not None and (spec.trials or 0) <= 50:
            _ok_or_difftrain(expand, spec)


_SDS_NAMES = [
    "pretrained_model_name_or_path",
    "train_data_dir",
    "resolution",
    "learning_rate",
    "max_train_steps",
    "network_dim",
    "network_alpha",
    "mixed_precision",
    "save_every_n_steps",
    "lr_warmup_steps",
    "max_grad_norm",
    "optimizer_type",
    "train_batch_size",
    "seed",
    "config_file",
    "bogus",
    "caption_extension",
    "keep_tokens",
]


@FUZZ
@given(
    st.sampled_from(["sdxl_train_network.py", "sdxl_train.py", "sd3_train_network.py", "x.py"]),
    st.lists(
        st.tuples(
            st.sampled_from(_SDS_NAMES), st.text(max_size=12) | st.sampled_from(["nan", "1e400", "-1", "0,0", ""])
        ),
        max_size=5,
    ),
)
def test_sd_scripts_command_lines(script, options):
    from difftrain.config.sdscripts import convert

    tokens = [script] + [t for name, v in options for t in ((f"--{name}", v) if v else (f"--{name}",))]
    c = _ok_or_difftrain(convert, tokens)
    if c is not None:
        _ok_or_difftrain(resolve, extra=c.config)
