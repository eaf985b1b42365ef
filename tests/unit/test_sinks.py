"""Metric sinks: metrics.jsonl always, TensorBoard scalars, Weights & Biases (offline) when asked."""

from __future__ import annotations

import json
import sys
import types

import pytest

from difftrain.config.schema import ReportConfig
from difftrain.errors import BackendUnavailable
from difftrain.trainers.sinks import MetricSinks


def test_jsonl_and_tensorboard_get_every_number(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = MetricSinks(tmp_path, ReportConfig())
    s.log({"step": 1, "epoch": 0, "loss": 0.5, "lr": 1e-4, "time": 1.0})
    s.log({"step": 2, "epoch": 0, "loss": 0.25, "lr": 1e-4, "time": 2.0})
    s.log({"step": 2, "val_loss": 0.3})
    s.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("loss", x.get("val_loss")) for x in lines] == [0.5, 0.25, 0.3]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/lr", "val/loss"}
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
    assert [e.value for e in acc.Scalars("val/loss")] == [pytest.approx(0.3)]


def test_wandb_runs_offline_with_the_config_and_gets_the_records(tmp_path, monkeypatch):
    calls = {}

    class Run:
        def log(self, data, step):
            calls.setdefault("log", []).append((step, data))

        def finish(self):
            calls["finished"] = True

    def init(**kw):
        calls["init"] = kw
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    s = MetricSinks(tmp_path, ReportConfig(to=["wandb"], wandb_project="cats"), config={"lora": {"rank": 8}}, name="r1")
    s.log({"step": 3, "loss": 0.1})
    s.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["project"] == "cats" and calls["init"]["name"] == "r1"
    assert calls["init"]["config"] == {"lora": {"rank": 8}} and calls["init"]["dir"] == str(tmp_path)
    assert calls["log"] == [(3, {"loss": 0.1})] and calls["finished"]
    assert not (tmp_path / "tensorboard").exists()


def test_asking_for_wandb_without_it_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(BackendUnavailable, match="pip install wandb"):
        MetricSinks(tmp_path, ReportConfig(to=["wandb"]))


def test_missing_tensorboard_costs_the_event_files_not_the_run(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *a, **k):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    s = MetricSinks(tmp_path, ReportConfig())
    s.log({"step": 1, "loss": 0.5})
    s.close()
    assert s.tb is None and (tmp_path / "metrics.jsonl").read_text().count("loss") == 1
    assert not (tmp_path / "tensorboard").exists()
