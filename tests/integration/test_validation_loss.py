"""The held-out validation loss: fixed (item, noise level, noise) triples, so it is deterministic."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.errors import ConfigError
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import Trainer


def _trainer(recipe, model, data, out, **extra):
    cfg = resolve(recipe=recipe, sets=tiny_sets(model, data, out, **extra)).config
    precompute(cfg)
    return Trainer(cfg)


@pytest.mark.slow
def test_sdxl_validation_loss_is_held_out_logged_and_repeatable(tiny_model, dataset, tmp_path):
    t = _trainer(
        "tiny-sdxl-lora",
        tiny_model,
        dataset,
        tmp_path,
        **{
            "train.max_steps": 4,
            "validation.every_n_steps": 2,
            "validation.loss_items": 2,
            "train.learning_rate": 1e-2,
        },
    )
    r = t.run()
    assert [s for s, _ in r.val_losses] == [2, 4]
    held = {it.latent for it in t.feed.val_items}
    assert len(held) == 2 and not held & {it.latent for it in t.feed.items} and len(t.feed.items) == 6
    # same weights, same triples: the same number, twice, and the one logged at the end
    a, b = t.validation_loss(), t.validation_loss()
    assert a == b == r.val_losses[-1][1]
    assert r.val_losses[0][1] != r.val_losses[1][1]  # training moved it
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["val_loss"] for rec in logged if "val_loss" in rec] == [v for _, v in r.val_losses]
    # another training seed holds out the same items (trials of a sweep compare on one set)
    other = _trainer(
        "tiny-sdxl-lora",
        tiny_model,
        dataset,
        tmp_path / "b",
        **{"train.seed": 7, "validation.loss_items": 2, "data.cache_dir": tmp_path / "cache"},
    )
    other.setup()
    assert {it.latent for it in other.feed.val_items} == held


def test_sd3_flow_validation_loss_is_repeatable(dataset, tmp_path):
    from difftrain.families.sd3 import SD3

    model = SD3().build_tiny(tmp_path / "tiny-sd3", seed=0)
    t = _trainer(
        "tiny-sd3-lora",
        model,
        dataset,
        tmp_path,
        **{"train.max_steps": 1, "validation.loss_items": 1, "validation.loss_timesteps": 3},
    )
    r = t.run()
    assert len(r.val_losses) == 1 and t.validation_loss() == r.val_losses[0][1] > 0


def test_holding_out_every_item_is_refused(tiny_model, dataset, tmp_path):
    t = _trainer("tiny-sdxl-lora", tiny_model, dataset, tmp_path, **{"validation.loss_items": 8})
    with pytest.raises(ConfigError, match="loss_items"):
        t.run()
