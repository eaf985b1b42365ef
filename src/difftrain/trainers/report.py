"""Run and sweep reports a person can read at a glance: PNG plots and one static HTML page.

A run folder gets ``plots/loss.png`` (training loss, raw and smoothed, with the
validation loss), ``plots/samples.png`` (validation samples: a row per prompt, a
column per step; the middle frame of each mp4 for video) and ``report.html``: the
numbers (steps, losses, s/step, the memory report of stats.json), the plots and the
resolved config, in one file with the plots embedded, so it can be mailed or
archived. A sweep folder gets the same page with its results table and every
trial's curve overlaid. Everything is drawn from files the run wrote
(metrics.jsonl, stats.json, config.yaml, samples/), so a report can be redrawn
at any time, also for a run that was stopped.

matplotlib draws with its Agg backend through ``Figure`` objects (no pyplot
state, no display needed).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any

from ..utils import atomic_write_bytes, atomic_write_text, read_json_object

#: columns of a results table with their header text (trials add one column per swept path)
STAT_LABELS = {
    "steps": "steps",
    "final_loss": "final loss",
    "best_loss": "best loss",
    "val_loss": "validation loss",
    "s_per_step": "s/step",
    "gpu_peak_alloc_gib": "GPU peak GiB",
    "gpu_peak_reserved_gib": "GPU reserved GiB",
}


# ----------------------------------------------------------------- reading a run
def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) of metrics.jsonl, one per step: a resumed run appends
    records again from its checkpoint, and the later record of a step wins. Unreadable lines are skipped."""
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if not isinstance(rec, dict) or "step" not in rec:
            continue
        if "val_loss" in rec:
            val[rec["step"]] = rec
        elif "loss" in rec:
            train[rec["step"]] = rec
    return [train[k] for k in sorted(train)], [val[k] for k in sorted(val)]


def run_summary(run_dir: Path) -> dict[str, Any]:
    """The numbers of a results-table row: steps, final and best training loss, last validation loss,
    s/step and peak GPU memory (from stats.json when the run finished)."""
    train, val = read_metrics(run_dir)
    losses = [r["loss"] for r in train if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    stats = read_json_object(Path(run_dir) / "stats.json")
    out: dict[str, Any] = {
        "steps": train[-1]["step"] if train else 0,
        "final_loss": losses[-1] if losses else None,
        "best_loss": min(losses) if losses else None,
        "val_loss": val[-1]["val_loss"] if val else None,
        "s_per_step": stats.get("s_per_step"),
        "gpu_peak_alloc_gib": stats.get("gpu_peak_alloc_gib"),
        "gpu_peak_reserved_gib": stats.get("gpu_peak_reserved_gib"),
    }
    if out["gpu_peak_alloc_gib"] is None and train:  # a run that did not finish: the last logged peak
        out["gpu_peak_alloc_gib"] = train[-1].get("gpu_peak_alloc_gib")
    return out


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** (i + 1)))
    return out


# ----------------------------------------------------------------- plots
def plot_losses(
    runs: dict[str, tuple[list[dict], list[dict]]], path: Path, title: str, named: bool = False
) -> Path | None:
    """Training loss (smoothed, raw faint when one run) and validation loss (dots) per run, on one axis;
    ``named``: label the lines by run even when there is one."""
    from matplotlib.figure import Figure

    if not any(train or val for train, val in runs.values()):
        return None
    fig = Figure(figsize=(9, 4.8), dpi=100)
    ax = fig.add_subplot()
    single = len(runs) == 1 and not named
    colors = [f"C{i % 10}" for i in range(len(runs))]
    values = []
    for (name, (train, val)), color in zip(runs.items(), colors):
        steps = [r["step"] for r in train if _finite(r.get("loss"))]
        losses = [r["loss"] for r in train if _finite(r.get("loss"))]
        values += losses
        if steps:
            if single:
                ax.plot(steps, losses, color=color, alpha=0.25, linewidth=1, label="training loss")
            ax.plot(
                steps,
                smooth(losses),
                color=color,
                linewidth=2,
                marker="o" if len(steps) < 3 else None,
                label="training loss (smoothed)" if single else name,
            )
        vsteps = [r["step"] for r in val if _finite(r.get("val_loss"))]
        vloss = [r["val_loss"] for r in val if _finite(r.get("val_loss"))]
        values += vloss
        if vsteps:
            ax.plot(
                vsteps,
                vloss,
                color=color,
                linestyle="--",
                marker="o",
                markersize=4,
                label="validation loss" if single else f"{name} (validation)",
            )
    if values and min(values) > 0 and max(values) / min(values) > 20:
        ax.set_yscale("log")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best", ncol=1 if len(runs) <= 8 else 2)
    fig.tight_layout()
    return _save_figure(fig, path)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _save_figure(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return path


def _sample_image(path: Path):
    """A PIL image of a sample: the PNG, or the middle frame of an mp4 (None when it cannot be read)."""
    from PIL import Image

    try:
        if path.suffix.lower() == ".mp4":
            import av

            with av.open(str(path)) as c:
                frames = [f.to_image() for f in c.decode(video=0)]
            return frames[len(frames) // 2] if frames else None
        with Image.open(path) as im:
            return im.convert("RGB")
    except Exception:  # noqa: BLE001 - a report shows what it can; a broken sample is left blank
        return None


def _step_order(tag: str) -> tuple[int, int]:
    if tag == "final":
        return (1, 0)
    digits = "".join(ch for ch in tag if ch.isdigit())
    return (0, int(digits) if digits else 0)


def _step_label(tag: str) -> str:
    return f"step {int(tag[5:])}" if tag.startswith("step-") and tag[5:].isdigit() else tag


def plot_trial_samples(trial_dirs: dict[str, Path], path: Path, max_rows: int = 12) -> Path | None:
    """A sweep's last validation samples side by side: one row per trial, one column per prompt."""
    from matplotlib.figure import Figure

    rows = []
    for name, d in trial_dirs.items():
        folder = Path(d) / "samples"
        tags = sorted((x.name for x in folder.iterdir() if x.is_dir()), key=_step_order) if folder.is_dir() else []
        if tags:
            files = sorted(p for p in (folder / tags[-1]).iterdir() if p.suffix.lower() in (".png", ".mp4"))
            if files:
                rows.append((name, tags[-1], files))
    rows = rows[:max_rows]
    if not rows:
        return None
    cols = max(len(f) for _, _, f in rows)
    fig = Figure(figsize=(2.2 * cols + 0.6, 2.2 * len(rows) + 0.4), dpi=100)
    axes = fig.subplots(len(rows), cols, squeeze=False)
    for r, (name, tag, files) in enumerate(rows):
        for c in range(cols):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            img = _sample_image(files[c]) if c < len(files) else None
            if img is not None:
                ax.imshow(img)
            if c == 0:
                ax.set_ylabel(f"{name}\n{_step_label(tag)}", fontsize=8)
            if r == 0:
                ax.set_title(f"prompt {c}", fontsize=9)
    fig.tight_layout()
    return _save_figure(fig, path)


def plot_samples(samples_dir: Path, path: Path, max_columns: int = 8) -> Path | None:
    """A grid of validation samples: one row per prompt, one column per validation step (``final`` last)."""
    from matplotlib.figure import Figure

    samples_dir = Path(samples_dir)
    if not samples_dir.is_dir():
        return None
    tags = sorted((d.name for d in samples_dir.iterdir() if d.is_dir()), key=_step_order)
    if len(tags) > max_columns:  # evenly spaced steps, always with the last
        keep = [tags[round(i * (len(tags) - 1) / (max_columns - 1))] for i in range(max_columns)]
        tags = list(dict.fromkeys(keep))
    names = sorted({p.name for t in tags for p in (samples_dir / t).iterdir() if p.suffix.lower() in (".png", ".mp4")})
    if not tags or not names:
        return None
    fig = Figure(figsize=(2.2 * len(tags), 2.2 * len(names) + 0.4), dpi=100)
    axes = fig.subplots(len(names), len(tags), squeeze=False)
    for r, name in enumerate(names):
        for c, tag in enumerate(tags):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            img = _sample_image(samples_dir / tag / name)
            if img is not None:
                ax.imshow(img)
            if r == 0:
                ax.set_title(_step_label(tag), fontsize=9)
            if c == 0:
                ax.set_ylabel(f"prompt {Path(name).stem}", fontsize=9)
    fig.tight_layout()
    return _save_figure(fig, path)


# ----------------------------------------------------------------- HTML
_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Roboto, sans-serif; margin: 2em auto; max-width: 1280px;
       color: #1d1d1f; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #d0d0d0; padding: 4px 10px; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
tr.best td { background: #e8f6e8; font-weight: 600; }
div.wide { overflow-x: auto; }
ul.problems { font-size: 0.85em; color: #444; } ul.problems li { margin: 0.3em 0; }
td.name { white-space: nowrap; }
td.status-ok { color: #1a7f37; } td.status-failed, td.status-oom, td.status-nan { color: #c62828; }
img.plot { max-width: 100%; border: 1px solid #eee; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 0.8em; }
"""


def _img(path: Path | None, alt: str) -> str:
    if path is None or not Path(path).is_file():
        return ""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"
    return html.escape(str(v))


def html_table(
    columns: list[tuple[str, str]], rows: list[dict], best: int | None = None, links: dict | None = None
) -> str:
    """A table of ``rows`` (dicts) under ``columns`` = [(key, header)]; row ``best`` highlighted."""
    head = "".join(f'<th class="{"l" if i == 0 else ""}">{html.escape(h)}</th>' for i, (_, h) in enumerate(columns))
    body = []
    for i, row in enumerate(rows):
        cells = []
        for j, (key, _) in enumerate(columns):
            text = _cell(row.get(key))
            if j == 0 and links and row.get(key) in links:
                text = f'<a href="{html.escape(links[row[key]])}">{text}</a>'
            cls = "l name" if j == 0 else ""
            if key == "status":
                cls = f"l status-{html.escape(str(row.get(key)))}"
            cells.append(f'<td class="{cls}">{text}</td>')
        attr = ' class="best"' if i == best else ""
        body.append(f"<tr{attr}>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _page(title: str, subtitle: str, sections: list[tuple[str, str]]) -> str:
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>',
        f'<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1><p class="sub">{html.escape(subtitle)}</p>',
    ]
    for heading, content in sections:
        if content:
            parts.append(f"<section><h2>{html.escape(heading)}</h2>{content}</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_run_report(run_dir: Path) -> Path:
    """plots/loss.png, plots/samples.png and report.html of one run folder."""
    run_dir = Path(run_dir)
    train, val = read_metrics(run_dir)
    loss_png = plot_losses({run_dir.name: (train, val)}, run_dir / "plots" / "loss.png", f"{run_dir.name}: loss")
    samples_png = plot_samples(run_dir / "samples", run_dir / "plots" / "samples.png")
    summary = run_summary(run_dir)
    stats = read_json_object(run_dir / "stats.json")
    numbers = html_table(
        [("what", "what"), ("value", "value")], [{"what": STAT_LABELS[k], "value": v} for k, v in summary.items()]
    )
    memory = (
        html_table([("what", "measurement"), ("value", "value")], [{"what": k, "value": v} for k, v in stats.items()])
        if stats
        else ""
    )
    config = run_dir / "config.yaml"
    cfg_html = (
        f"<details><summary>config.yaml</summary><pre>{html.escape(config.read_text(encoding='utf-8'))}</pre></details>"
        if config.is_file()
        else ""
    )
    page = _page(
        f"difftrain run: {run_dir.name}",
        str(run_dir.resolve()),
        [
            ("Summary", numbers),
            ("Loss", _img(loss_png, "loss curves")),
            ("Validation samples", _img(samples_png, "validation samples")),
            ("Memory and time (stats.json)", memory),
            ("Configuration", cfg_html),
        ],
    )
    out = run_dir / "report.html"
    atomic_write_text(out, page)
    return out


def write_sweep_report(
    sweep_dir: Path,
    rows: list[dict],
    columns: list[tuple[str, str]],
    trial_dirs: dict[str, Path],
    sort_key: str | None = None,
    axes: tuple[str, ...] = (),
) -> Path:
    """plots/loss.png (every trial's training loss overlaid), plots/val_loss.png and report.html of a sweep.
    Plot legends name each trial with its swept values (``axes``)."""
    sweep_dir = Path(sweep_dir)
    label = {
        r["trial"]: r["trial"]
        + (" (" + ", ".join(f"{a.rsplit('.', 1)[-1]}={_cell(r.get(a))}" for a in axes) + ")" if axes else "")
        for r in rows
    }
    runs = {label.get(name, name): read_metrics(d) for name, d in trial_dirs.items()}
    loss_png = plot_losses(
        {k: (t, []) for k, (t, _) in runs.items()},
        sweep_dir / "plots" / "loss.png",
        "training loss (smoothed), every trial",
        named=True,
    )
    val_png = plot_losses(
        {k: ([], v) for k, (_, v) in runs.items() if v},
        sweep_dir / "plots" / "val_loss.png",
        "validation loss, every trial",
        named=True,
    )
    samples_png = plot_trial_samples(
        {label[r["trial"]].replace(" (", "\n("): trial_dirs[r["trial"]] for r in rows if r["trial"] in trial_dirs},
        sweep_dir / "plots" / "samples.png",
    )
    best = _best_row(rows)
    links = {
        name: f"{d.relative_to(sweep_dir).as_posix()}/report.html"
        for name, d in trial_dirs.items()
        if (d / "report.html").is_file() and d.is_relative_to(sweep_dir)
    }
    done = sum(r.get("status") == "ok" for r in rows)
    page = _page(
        f"difftrain sweep: {sweep_dir.name}",
        f"{len(rows)} trials, {done} finished; {('sorted by ' + sort_key) if sort_key else 'in sweep order'}; best validation "
        "(else final) loss highlighted",
        [
            (
                "Results",
                '<div class="wide">'
                + html_table([c for c in columns if c[0] != "error"], rows, best=best, links=links)
                + "</div>",
            ),
            ("Trials that did not finish", _problems(rows)),
            ("Training loss", _img(loss_png, "training loss of every trial")),
            ("Validation loss", _img(val_png, "validation loss of every trial")),
            ("Last validation samples of each trial", _img(samples_png, "validation samples of every trial")),
        ],
    )
    out = sweep_dir / "report.html"
    atomic_write_text(out, page)
    return out


def _problems(rows: list[dict]) -> str:
    items = [
        f"<li><b>{html.escape(str(r['trial']))}</b> ({html.escape(str(r.get('status')))}): "
        f"{html.escape(str(r.get('error') or ''))}</li>"
        for r in rows
        if r.get("status") not in ("ok", "pending")
    ]
    return f'<ul class="problems">{"".join(items)}</ul>' if items else ""


def _best_row(rows: list[dict]) -> int | None:
    for key in ("val_loss", "final_loss"):
        scored = [(r[key], i) for i, r in enumerate(rows) if r.get("status") == "ok" and _finite(r.get(key))]
        if scored:
            return min(scored)[1]
    return None
