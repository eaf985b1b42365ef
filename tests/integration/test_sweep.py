"""difftrain sweep over the tiny SDXL: one cache, trials in child processes, statuses, resume, results and report."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from difftrain.flows.sweep import SweepSpec, expand, load_spec, parse_dist, parse_grid, sort_rows, trial_name

pytestmark = pytest.mark.slow

LR_OK, LR_DIVERGES = "0.001", "1e30"


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_model, _dataset_master):
    """A 2x2 grid: learning rate (fine / diverging) x optimizer (adamw / cpu_offload, which the config refuses
    with gradient clipping on): statuses ok, nan and twice failed; two trials at once (--gpus 2)."""
    from typer.testing import CliRunner

    from difftrain.cli.app import app
    from difftrain.families.sdxl import SDXL

    root = tmp_path_factory.mktemp("sweep")
    calls = []
    real = SDXL.encode_images

    def counting(self, comps, pixels):
        calls.append(pixels.shape[0])
        return real(self, comps, pixels)

    SDXL.encode_images = counting
    try:
        args = [
            "sweep",
            "--recipe",
            "tiny-sdxl-lora",
            "--model",
            str(tiny_model),
            "--data-dir",
            str(_dataset_master),
            "--set",
            f"data.cache_dir={root / 'cache'}",
            "--set",
            "train.max_steps=4",
            "--set",
            "train.batch_size=2",
            "--set",
            "validation.loss_items=2",
            "--set",
            "validation.every_n_steps=2",
            "--set",
            "validation.prompts=[a red circle]",
            "--set",
            "validation.num_inference_steps=1",
            "--set",
            "validation.resolution=64",
            "--grid",
            f"optimizer.lr={LR_OK},{LR_DIVERGES}",
            "--grid",
            "memory.optimizer.kind=adamw,cpu_offload",
            "--gpus",
            "2",
            "-o",
            str(root / "sw"),
        ]
        r = CliRunner().invoke(app, args, catch_exceptions=False)
    finally:
        SDXL.encode_images = real
    assert r.exit_code == 0, r.output
    return root / "sw", args, sum(calls)


def _rows(sw: Path) -> list[dict]:
    return json.loads((sw / "results.json").read_text())


def test_a_grid_sweep_runs_every_trial_over_one_cache(swept):
    sw, _, encoded = swept
    assert encoded == 8  # every image of the dataset went through the VAE once, for all four trials
    rows = {(r["train.learning_rate"], r["memory.optimizer.kind"]): r for r in _rows(sw)}
    assert set(rows) == {(1e-3, "adamw"), (1e30, "adamw"), (1e-3, "cpu_offload"), (1e30, "cpu_offload")}
    ok, nan = rows[(1e-3, "adamw")], rows[(1e30, "adamw")]
    assert (
        ok["status"] == "ok"
        and ok["steps"] == 4
        and ok["final_loss"] > 0
        and ok["val_loss"] > 0
        and ok["s_per_step"] > 0
    )
    assert nan["status"] == "nan" and "loss became" in nan["error"]
    for opt_off in (rows[(1e-3, "cpu_offload")], rows[(1e30, "cpu_offload")]):  # refused by the config: never started
        assert opt_off["status"] == "failed" and "cpu_offload" in opt_off["error"] and opt_off["steps"] is None
    # both trials that ran did so at once, one per "GPU"
    gpus = {json.loads((sw / "trials" / r["trial"] / "result.json").read_text())["gpu"] for r in (ok, nan)}
    assert gpus == {"0", "1"}
    # each trial folder holds its resolved config, with its own values
    cfg = (sw / "trials" / ok["trial"] / "config.yaml").read_text()
    assert "learning_rate: 0.001" in cfg and f"output_dir: {sw / 'trials' / ok['trial']}" in cfg


def test_results_are_written_as_csv_json_plots_and_a_report(swept):
    sw, _, _ = swept
    with open(sw / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and {
        "trial",
        "train.learning_rate",
        "memory.optimizer.kind",
        "status",
        "final_loss",
        "best_loss",
        "val_loss",
        "s_per_step",
        "gpu_peak_alloc_gib",
        "error",
    } <= set(table[0])
    assert len((sw / "trials.jsonl").read_text().splitlines()) == 4
    for png in ("loss.png", "val_loss.png", "samples.png"):
        assert (sw / "plots" / png).stat().st_size > 5000
    ok = next(r for r in _rows(sw) if r["status"] == "ok")
    run = sw / "trials" / ok["trial"]
    for f in (
        "metrics.jsonl",
        "report.html",
        "plots/loss.png",
        "plots/samples.png",
        "pytorch_lora_weights.safetensors",
    ):
        assert (run / f).is_file(), f
    assert list((run / "tensorboard").glob("events.out.tfevents.*")) and list(
        (sw / "tensorboard").rglob("events.out.tfevents.*")
    )
    html = (sw / "report.html").read_text()
    assert (
        html.count("<tr") == 5
        and html.count("data:image/png;base64,") == 3
        and f'href="trials/{ok["trial"]}/report.html"' in html
    )


def test_rerunning_continues_the_study_and_runs_no_finished_trial_again(swept):
    """The study (study.db in the sweep folder) knows every trial's end: a rerun of the same command runs none."""
    from typer.testing import CliRunner

    from difftrain.cli.app import app

    sw, args, _ = swept
    stamps = {p: p.stat().st_mtime_ns for p in (sw / "trials").glob("*/result.json")}
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0 and "(continued, grid sampler" in r.output and "1 finished, 3 failed" in r.output
    assert "sweep: trial #" not in r.output
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert [r["number"] for r in _rows(sw)] == [0, 1, 2, 3]


def test_sweep_report_re_renders_sorted(swept, tmp_path):
    from typer.testing import CliRunner

    from difftrain.cli.app import app

    sw, _, _ = swept
    copy = Path(shutil.copytree(sw, tmp_path / "copy"))
    r = CliRunner().invoke(app, ["sweep", "report", str(copy), "--sort", "final_loss"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = _rows(copy)
    finals = [x["final_loss"] for x in rows if x["final_loss"] is not None]
    assert finals == sorted(finals) and rows[-1]["final_loss"] is None
    r = CliRunner().invoke(app, ["sweep", "report", str(copy), "--sort", "nope"])
    assert r.exit_code != 0


def test_the_report_page_renders_in_headless_chromium(swept, tmp_path):
    """The sweep page and a trial's page in a real browser: the table's rows are there and every plot decoded."""
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium, driver_path = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium.webdriver.chrome.service import Service

    sw, _, _ = swept
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,2000",
    ):
        opts.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        browser.get((sw / "report.html").as_uri())
        assert "difftrain sweep" in browser.title
        rows = browser.execute_script("return document.querySelectorAll('table tbody tr').length")
        widths = browser.execute_script("return [...document.images].map(i => i.complete ? i.naturalWidth : 0)")
        statuses = browser.execute_script(
            "return [...document.querySelectorAll('td[class*=status]')].map(t => t.textContent)"
        )
        assert rows == 4 and len(widths) == 3 and all(w > 100 for w in widths)
        assert sorted(statuses) == ["failed", "failed", "nan", "ok"]
        browser.save_screenshot(str(sw / "report.png"))
        ok = next(r for r in _rows(sw) if r["status"] == "ok")
        browser.get((sw / "trials" / ok["trial"] / "report.html").as_uri())
        widths = browser.execute_script("return [...document.images].map(i => i.complete ? i.naturalWidth : 0)")
        assert len(widths) == 2 and all(w > 100 for w in widths)  # loss curves and the samples grid
    finally:
        browser.quit()


def test_random_search_is_reproducible_and_draws_from_its_distributions():
    spec = SweepSpec(
        recipe="tiny-sdxl-lora",
        grid={"lora.rank": [4, 8]},
        trials=6,
        seed=3,
        dists={"train.learning_rate": {"log_uniform": [1e-5, 1e-3]}, "train.seed": {"int_uniform": [0, 9]}},
    )
    a, b = expand(spec), expand(spec)
    assert a == b and len(a) == 6
    assert all(
        1e-5 <= t["train.learning_rate"] <= 1e-3 and t["lora.rank"] in (4, 8) and 0 <= t["train.seed"] <= 9 for t in a
    )
    assert len({t["train.learning_rate"] for t in a}) == 6
    spec.seed = 4
    assert expand(spec) != a
    assert [trial_name(t, spec) for t in a] == [trial_name(t, spec) for t in a]


def test_grid_product_order_aliases_and_a_sweep_file(tmp_path):
    assert parse_grid("optimizer.lr=1e-4,3e-4") == ("train.learning_rate", [1e-4, 3e-4])
    assert parse_grid("lora.targets=[to_q, to_k],[to_v]") == ("lora.targets", [["to_q", "to_k"], ["to_v"]])
    assert parse_dist("lr=log_uniform:1e-5:1e-3") == ("train.learning_rate", {"log_uniform": [1e-5, 1e-3]})
    spec = SweepSpec(grid={"a.x": [1, 2], "b.y": ["p", "q"]})
    assert expand(spec) == [
        {"a.x": 1, "b.y": "p"},
        {"a.x": 1, "b.y": "q"},
        {"a.x": 2, "b.y": "p"},
        {"a.x": 2, "b.y": "q"},
    ]
    f = tmp_path / "sweep.yaml"
    f.write_text(
        "recipe: tiny-sdxl-lora\nset: {train.max_steps: 5}\ngrid: {lora.rank: [4, 8]}\n"
        "random: {trials: 3, seed: 1, axes: {train.learning_rate: {log_uniform: [1.0e-5, 1.0e-3]}}}\n"
    )
    spec = load_spec(f)
    assert spec.sets == ["train.max_steps=5"] and spec.trials == 3 and len(expand(spec)) == 3
    from difftrain.errors import UsageError

    f.write_text("grid: {lora.rank: [4]}\nrandom: {trials: 2, axes: {train.learning_rate: {gaussian: [0, 1]}}}\n")
    with pytest.raises(UsageError, match="log_uniform"):
        load_spec(f)
    with pytest.raises(UsageError, match="--random"):
        expand(SweepSpec(dists={"a.x": {"uniform": [0, 1]}}))


def test_sort_rows_puts_empty_cells_last():
    rows = [{"v": 2.0}, {"v": None}, {"v": 1.0}]
    assert [r["v"] for r in sort_rows(rows, "v")] == [1.0, 2.0, None]
    assert [r["v"] for r in sort_rows(rows, "v", descending=True)] == [2.0, 1.0, None]
