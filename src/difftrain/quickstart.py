"""difftrain quickstart: the whole flow on a tiny seeded SDXL, with no downloads.

Generates a dozen synthetic images (shapes and colours, mixed aspect ratios)
with captions and WD14-style tags, builds a tiny SDXL as a diffusers folder,
then runs merge-tags -> precompute -> train (LoRA) -> export -> one sample.
Running it again reuses the model, the data and the cache.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from .config.load import resolve
from .console import info
from .data.tags import merge_tags
from .families.registry import get_family
from .precompute.run import precompute
from .trainers.export import LORA_FILE
from .trainers.loop import train

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SIZES = ((256, 256), (320, 192), (192, 320), (256, 128))

#: the recipe the walk-through trains (its family builds the tiny model)
RECIPE = "tiny-sdxl-lora"


def make_dataset(folder: Path, n: int = 12, seed: int = 0) -> Path:
    """Write ``n`` images with a .caption and a WD14-style .txt tag file each."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n):
        shape = SHAPES[i % len(SHAPES)]
        colour = list(COLOURS)[i % len(COLOURS)]
        w, h = SIZES[i % len(SIZES)]
        img = Image.new("RGB", (w, h), (250, 250, 250))
        d = ImageDraw.Draw(img)
        s = min(w, h) * rng.uniform(0.45, 0.7)
        cx, cy = w / 2 + rng.uniform(-0.1, 0.1) * w, h / 2 + rng.uniform(-0.1, 0.1) * h
        box = (cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2)
        fill = COLOURS[colour]
        if shape == "circle":
            d.ellipse(box, fill=fill)
        elif shape == "square":
            d.rectangle(box, fill=fill)
        else:
            d.polygon([(cx, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
        stem = f"{i:02d}_{colour}_{shape}"
        img.save(folder / f"{stem}.png")
        (folder / f"{stem}.caption").write_text(f"a {colour} {shape} on a white background", encoding="utf-8")
        (folder / f"{stem}.txt").write_text(f"{shape}, {colour}, simple_background, white_background", encoding="utf-8")
    return folder


@dataclass
class QuickstartResult:
    out: Path
    outputs: dict[str, Path | None] = field(default_factory=dict)  # None: not written (the trainer's lora_path)
    seconds: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)


def run_quickstart(out: Path, steps: int | None = None, seed: int = 0) -> QuickstartResult:
    out = Path(out)
    res = QuickstartResult(out)
    t = time.time()

    def lap(name: str) -> None:
        nonlocal t
        res.seconds[name] = time.time() - t
        t = time.time()

    data, model, meta = out / "data", out / "model", out / "metadata.json"
    family = get_family(resolve(recipe=RECIPE).config.family)
    if not (data.is_dir() and any(data.glob("*.png"))):
        make_dataset(data, seed=seed)
    if not (model / "model_index.json").exists():
        family.build_tiny(model, seed=seed)
    lap("data and tiny model")
    report = merge_tags(data, meta, tag_ext=".txt", caption_ext=".caption")
    info(f"merge-tags: {report.images} images, {report.with_tags} with tags -> {meta}")
    lap("merge-tags")

    sets = [
        f"model.path={model}",
        f"data.dir={data}",
        f"data.metadata={meta}",
        f"data.cache_dir={out / 'cache'}",
        f"train.output_dir={out / 'run'}",
        "data.caption_source=caption_and_tags",
    ]
    if steps:
        sets.append(f"train.max_steps={steps}")
    resolved = resolve(recipe=RECIPE, sets=sets)
    cfg = resolved.config
    pre = precompute(cfg)
    info(
        f"precompute: {pre.latents_encoded} latents and {pre.texts_encoded} captions encoded, "
        f"{pre.latents_reused + pre.texts_reused} reused"
    )
    lap("precompute")
    if (out / "run" / "checkpoints").exists():  # a rerun trains afresh over the reused cache
        import shutil

        shutil.rmtree(out / "run")
    tr = train(cfg, config_yaml=resolved.to_yaml())
    res.losses = tr.losses
    lap("train")
    res.outputs.update(
        {
            "data": data,
            "model": model,
            "metadata": meta,
            "cache": out / "cache",
            "run": out / "run",
            "lora": tr.lora_path,
        }
    )
    res.outputs["sample"] = sample(
        cfg, out / "run" / LORA_FILE, out / "sample.png", prompt="a red circle on a white background"
    )
    lap("sample")
    return res


def sample(cfg, lora: Path, dest: Path, prompt: str, steps: int = 10, seed: int = 0) -> Path:
    """One image from the diffusers SDXL pipeline with the exported LoRA loaded."""
    import torch

    family = get_family(cfg.family)
    # on the CPU, every family's default (named: ModelFamily.load declares none)
    comps = family.load(cfg.model, ["unet", "vae", "text_encoder", "text_encoder_2"], dtype=torch.float32, device="cpu")
    pipe = family.pipeline(comps, cfg.model)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    pipe.set_progress_bar_config(disable=True)
    size = cfg.data.resolution
    image = pipe(
        prompt, num_inference_steps=steps, height=size, width=size, generator=torch.Generator().manual_seed(seed)
    ).images[0]
    image.save(dest)
    return dest
