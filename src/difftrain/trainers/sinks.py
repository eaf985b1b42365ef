"""Where a run's metrics go: metrics.jsonl always, TensorBoard and Weights & Biases when report.to asks.

One record per logged step (``{"step", "epoch", "loss", "lr", "time", ...}``) or per
validation (``{"step", "val_loss"}``). The JSONL file is the source the run and sweep
reports are drawn from; TensorBoard gets every number as a scalar under ``train/`` or
``val/``; W&B gets the same dict (offline by default: ``wandb sync`` uploads later).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..config.schema import ReportConfig
from ..console import warn
from ..errors import BackendUnavailable

#: record keys that are coordinates, not metrics
_AXES = ("step", "epoch", "time")


class MetricSinks:
    def __init__(self, out: Path, report: ReportConfig, config: dict | None = None, name: str | None = None) -> None:
        self.jsonl = open(out / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.tb = self.wandb = None
        try:
            if "tensorboard" in report.to:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as e:  # the default sink: its absence costs the event files, not the run
                    warn(
                        f"no TensorBoard event files: tensorboard does not import ({e}); pip install tensorboard, "
                        "or set report.to: [] (metrics.jsonl is written either way)"
                    )
                else:
                    self.tb = SummaryWriter(log_dir=str(out / "tensorboard"))
            if "wandb" in report.to:
                try:
                    import wandb
                except ImportError:
                    raise BackendUnavailable(
                        "report.to has wandb, but Weights & Biases is not installed.",
                        hint="pip install wandb, or drop wandb from report.to.",
                    ) from None
                self.wandb = wandb.init(
                    project=report.wandb_project,
                    name=name,
                    dir=str(out),
                    config=config,
                    mode=report.wandb_mode,
                    resume="allow",
                )
        except BaseException:
            self.close()
            raise

    def log(self, rec: dict) -> None:
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()
        step = rec.get("step", 0)
        for key, value in rec.items():
            if (
                key in _AXES
                or not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                continue
            if self.tb is not None:
                self.tb.add_scalar(("val/" + key[4:]) if key.startswith("val_") else f"train/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if k != "step"}, step=step)

    def close(self) -> None:
        if self.jsonl is not None and not self.jsonl.closed:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class NoSinks:
    """The metric sinks of processes other than the first: they log nothing."""

    def log(self, rec: dict) -> None:
        pass

    def close(self) -> None:
        pass


def write_report_page(out: Path) -> None:
    """The run's report.html (report.html: true), from the metrics it wrote."""
    try:
        from .report import write_run_report

        write_run_report(out)
    except ImportError as e:  # matplotlib missing: the run's results stand without their page
        warn(f"no report.html: {e} (pip install matplotlib)")
