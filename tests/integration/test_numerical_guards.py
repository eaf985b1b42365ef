"""NaN/inf losses: the run stops naming the step, the likely cause and the last good checkpoint, or skips the
step (train.nonfinite: skip); the fp16 grad scaler's skipped steps are counted."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.errors import LossNotFinite
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import Trainer, train


def _cfg(model, data, out, **extra):
    base = {"train.batch_size": 2, "train.checkpoint_every": 2, "data.cache_dir": out.parent / "cache"}
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(model, data, out, **{**base, **extra})).config


def _poison(monkeypatch, steps):
    """The cached latents of the batches of these (1-based) steps hold a NaN, as a damaged cache would."""
    from difftrain.trainers.feed import Feed

    real, real_setup, runs = Feed.batch, Trainer.setup, []

    def setup(self, *args, **kwargs):
        runs.append(self)  # the run whose position says which step a batch is for
        real_setup(self, *args, **kwargs)

    def batch(self, items, epoch=0, augment=False):
        b = real(self, items, epoch, augment)
        if augment and runs[-1].pos.step + 1 in steps:
            b["latents"] = b["latents"].clone()
            b["latents"][0, 0, 0, 0] = float("nan")
        return b

    monkeypatch.setattr(Trainer, "setup", setup)
    monkeypatch.setattr(Feed, "batch", batch)


def test_a_nan_from_the_cache_stops_with_the_step_the_cause_and_the_last_checkpoint(
    tiny_model, dataset, tmp_path, monkeypatch
):
    cfg = _cfg(tiny_model, dataset, tmp_path / "run", **{"train.max_steps": 6, "speed.sync_seconds": 1e6})
    precompute(cfg)
    _poison(monkeypatch, {3})
    with pytest.raises(LossNotFinite) as e:
        train(cfg)
    msg = e.value.message
    assert "At step 3 the loss became nan" in msg and "cached latents" in msg
    assert "step-00000002" in msg and "precompute" in e.value.hint
    # read back at the checkpoint of step 4 (not every step), before that checkpoint could hold NaN weights
    ckpts = sorted(p.name for p in (tmp_path / "run" / "run" / "checkpoints").iterdir())
    assert ckpts == ["step-00000002"]


def test_a_diverging_learning_rate_is_named(tiny_model, dataset, tmp_path, cli):
    out = tmp_path / "run"
    sets = tiny_sets(
        tiny_model,
        dataset,
        out,
        **{
            "train.max_steps": 4,
            "train.learning_rate": 1e30,
            "train.checkpoint_every": 100,
            "data.cache_dir": tmp_path / "cache",
        },
    )
    args = [a for s in sets for a in ("--set", s)]
    assert cli("precompute", "--recipe", "tiny-sdxl-lora", *args).code == 0
    r = cli("train", "--recipe", "tiny-sdxl-lora", *args)
    assert r.code != 0 and "Traceback" not in r.err
    assert "became nan" in r.err and "learning rate (1e+30)" in r.err and "No checkpoint was saved before it" in r.err


def test_skip_mode_drops_the_bad_steps_and_finishes(tiny_model, dataset, tmp_path, monkeypatch):
    cfg = _cfg(tiny_model, dataset, tmp_path / "run", **{"train.max_steps": 6, "train.nonfinite": "skip"})
    precompute(cfg)
    _poison(monkeypatch, {3, 4})
    res = train(cfg)
    assert [i + 1 for i, x in enumerate(res.losses) if x != x] == [3, 4]
    assert all(torch.isfinite(v).all() for v in load_file(res.lora_path).values())  # no NaN reached the weights
    stats = json.loads((tmp_path / "run" / "run" / "stats.json").read_text())
    assert stats["nonfinite_skipped_steps"] == 2
    recs = {
        r["step"]: r for r in map(json.loads, (tmp_path / "run" / "run" / "metrics.jsonl").read_text().splitlines())
    }
    assert recs[3].get("skipped") and recs[4].get("skipped") and not recs[5].get("skipped")


@pytest.mark.slow
def test_skip_mode_stops_after_five_bad_steps_in_a_row(tiny_model, dataset, tmp_path, monkeypatch):
    cfg = _cfg(tiny_model, dataset, tmp_path / "run", **{"train.max_steps": 12, "train.nonfinite": "skip"})
    precompute(cfg)
    _poison(monkeypatch, set(range(3, 13)))
    with pytest.raises(LossNotFinite, match="5 steps in a row: At step 7"):
        train(cfg)


@pytest.mark.slow
def test_fp16_scaler_skips_are_counted(tiny_model, dataset, tmp_path, monkeypatch):
    """A scale so large that fp16 gradients overflow: the scaler skips steps (halving its scale each time) and the
    run reports how many."""
    cfg = _cfg(
        tiny_model,
        dataset,
        tmp_path / "run",
        **{"train.max_steps": 4, "train.mixed_precision": "fp16", "train.checkpoint_every": 100},
    )
    precompute(cfg)
    real = torch.amp.GradScaler.__init__
    monkeypatch.setattr(
        torch.amp.GradScaler, "__init__", lambda self, *a, **k: real(self, *a, **{**k, "init_scale": 2.0**126})
    )
    t = Trainer(cfg)
    res = t.run()
    assert 1 <= t.guards.fp16_skipped <= 4
    assert res.stats["fp16_skipped_steps"] == t.guards.fp16_skipped
