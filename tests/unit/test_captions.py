"""Caption augmentation: keep_tokens, shuffling, tag dropout, cached variants and the per-epoch draw."""

from __future__ import annotations

import random

import pytest

from difftrain.config.load import resolve
from difftrain.config.sdscripts import convert
from difftrain.data.captions import CaptionAugment, augment_caption, caption_variants, live_caption, pick_text

TAGS = "1girl, solo, red hair, smile, outdoors, hat, looking at viewer"


def test_keep_tokens_stay_first_and_the_rest_is_a_permutation():
    aug = CaptionAugment(shuffle=True, keep_tokens=2)
    outs = {augment_caption(TAGS, aug, random.Random(i)) for i in range(20)}
    assert len(outs) > 5  # it does shuffle
    for out in outs:
        tags = out.split(", ")
        assert tags[:2] == ["1girl", "solo"]
        assert sorted(tags[2:]) == sorted(TAGS.split(", ")[2:])


def test_keep_tokens_separator_keeps_what_precedes_it():
    aug = CaptionAugment(shuffle=True, keep_tokens=5, keep_tokens_separator="|||")
    out = augment_caption("sks woman, portrait ||| red hair, smile, hat", aug, random.Random(3))
    tags = out.split(", ")
    assert tags[:2] == ["sks woman", "portrait"] and sorted(tags[2:]) == ["hat", "red hair", "smile"]
    assert "|||" not in out


def test_tag_dropout_drops_only_unkept_tags_at_about_the_rate():
    aug = CaptionAugment(keep_tokens=1, tag_dropout_rate=0.5)
    rng = random.Random(0)
    kept = 0
    for _ in range(400):
        tags = augment_caption(TAGS, aug, rng).split(", ")
        assert tags[0] == "1girl"
        assert tags[1:] == [t for t in TAGS.split(", ")[1:] if t in tags[1:]]  # order kept without shuffle
        kept += len(tags) - 1
    assert 0.4 < kept / (400 * 6) < 0.6


def test_custom_separator():
    aug = CaptionAugment(shuffle=True, separator=";")
    out = augment_caption("a; b; c; d", aug, random.Random(1))
    assert sorted(out.split(", ")) == ["a", "b", "c", "d"]


def test_no_augmentation_leaves_the_caption_alone():
    aug = CaptionAugment()
    assert augment_caption("a photo, of  a cat", aug, random.Random(0)) == "a photo, of  a cat"
    assert caption_variants("a photo, of a cat", aug) == ["a photo, of a cat"]


def test_variants_are_distinct_deterministic_and_capped_by_what_exists():
    aug = CaptionAugment(shuffle=True, variants=6)
    v = caption_variants(TAGS, aug)
    assert len(v) == 6 and len(set(v)) == 6
    assert caption_variants(TAGS, aug) == v  # seeded by the caption alone: a rerun finds the same keys
    assert caption_variants(TAGS + ", extra", aug) != v
    two = caption_variants("a, b", CaptionAugment(shuffle=True, variants=8))
    assert sorted(two) == ["a, b", "b, a"]


def test_pick_text_draws_per_epoch_and_item_and_honours_dropout():
    from difftrain.data.index import IndexItem

    variants = tuple({"s": f"v{i}"} for i in range(4))
    item = IndexItem(key="img/1", latent="l", texts={"s": "orig"}, bucket=(64, 64), text_variants=variants)
    empty = {"s": "empty"}
    aug = CaptionAugment(shuffle=True, variants=4)
    picks = [pick_text(item, aug, 42, e, empty)["s"] for e in range(40)]
    assert picks == [pick_text(item, aug, 42, e, empty)["s"] for e in range(40)]  # reproducible (resume)
    assert set(picks) == {"v0", "v1", "v2", "v3"}
    assert [pick_text(item, aug, 7, e, empty)["s"] for e in range(40)] != picks  # the seed matters
    all_empty = CaptionAugment(shuffle=True, variants=4, dropout_rate=1.0)
    assert {pick_text(item, all_empty, 42, e, empty)["s"] for e in range(10)} == {"empty"}
    half = CaptionAugment(dropout_rate=0.5)
    drawn = [pick_text(item, half, 42, e, empty)["s"] for e in range(400)]
    assert set(drawn) == {"empty", "orig"} and 150 < drawn.count("empty") < 250
    assert pick_text(item, CaptionAugment(), 42, 0, empty) == {"s": "orig"}


def test_live_caption_is_augmented_afresh_or_dropped():
    aug = CaptionAugment(shuffle=True, keep_tokens=1, dropout_rate=0.25)
    outs = [live_caption(TAGS, aug, 1, e, "k") for e in range(200)]
    assert outs == [live_caption(TAGS, aug, 1, e, "k") for e in range(200)]
    assert 25 < outs.count("") < 80
    assert len({o for o in outs if o}) > 20 and all(o.startswith("1girl, ") for o in outs if o)


def test_config_bounds_and_sd_scripts_flags():
    with pytest.raises(Exception, match="caption_tag_dropout_rate"):
        resolve(recipe="tiny-sdxl-lora", sets=["data.caption_tag_dropout_rate=1.0"])
    c = convert(
        [
            "sdxl_train_network.py",
            "--network_module=networks.lora",
            "--shuffle_caption",
            "--keep_tokens=2",
            "--caption_dropout_rate=0.1",
            "--caption_tag_dropout_rate=0.05",
            "--keep_tokens_separator=|||",
        ]
    )
    d = resolve(extra=c.config).config.data
    assert (
        d.shuffle_caption,
        d.keep_tokens,
        d.caption_dropout_rate,
        d.caption_tag_dropout_rate,
        d.keep_tokens_separator,
    ) == (True, 2, 0.1, 0.05, "|||")
    assert not [u for u in c.unmapped if "caption" in u[0] or "keep_tokens" in u[0]]
