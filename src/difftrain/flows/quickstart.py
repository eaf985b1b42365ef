"""difftrain quickstart: the whole flow on a family's tiny seeded model, with no downloads.

Image families (SDXL, SD3): a dozen synthetic images (shapes and colours, mixed
aspect ratios) with captions and WD14-style tags, a tiny model as a diffusers
folder, then merge-tags -> precompute -> train (LoRA) -> export -> one sample
from the family's stock diffusers pipeline with the exported LoRA loaded.
Video families (CogVideoX, CogVideoX image-to-video): short
synthetic clips of a square moving over a colour, with captions, written
through PyAV (the video extra), then precompute -> train -> export -> one mp4
sample, the trainer's validation video (image-to-video from a start image).
Running it again reuses the model,
the data and the cache.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config.load import resolve
from ..console import info
from ..data.tags import merge_tags
from ..families.registry import get_family
from ..precompute.run import precompute
from ..trainers.export import LORA_FILE
from ..trainers.loop import train

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SIZES = ((256, 256), (320, 192), (192, 320), (256, 128))


def quickstart_families() -> list[str]:
    """The families ``quickstart --family`` runs: those with a tiny recipe, in the registry's order."""
    from ..families.registry import names

    return [n for n in names() if get_family(n).tiny_recipe]


def _flow_sets(family: str) -> tuple[str, list[str]]:
    """(the family's tiny recipe, the settings that make it this family's tiny model when the recipe is another's)."""
    from ..config.recipes import load_recipe

    fam = get_family(family)
    recipe = fam.tiny_recipe
    assert recipe is not None, family
    if load_recipe(recipe).get("family") == family:
        return recipe, []
    return recipe, [f"family={family}", f"model.config={fam.tiny_config}"]


PROMPT = "a red circle on a white background"


def make_controls(data: Path, folder: Path) -> Path:
    """Edit training's references of each image of ``data`` in ``folder``, numbered as musubi-tuner numbers them:
    ``<name>_0.png`` the image mirrored, ``<name>_1.png`` in grey."""
    from PIL import Image, ImageOps

    folder.mkdir(parents=True, exist_ok=True)
    for f in sorted(data.glob("*.png")):
        if not (folder / f"{f.stem}_1.png").exists():
            im = Image.open(f).convert("RGB")
            ImageOps.mirror(im).save(folder / f"{f.stem}_0.png")
            ImageOps.grayscale(im).convert("RGB").save(folder / f"{f.stem}_1.png")
    return folder


CLIP_PROMPT = "a white square moving over a red background"


def make_clips(folder: Path, n: int = 3, frames: int = 12, size: int = 64, seed: int = 0) -> Path:
    """Write ``n`` short mp4 clips (a white square moving over a plain colour) with a .caption each."""
    import numpy as np

    from ..data.video import write_mp4

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n):
        name, colour = list(COLOURS.items())[i % len(COLOURS)]
        arr = np.tile(np.array(colour, dtype=np.uint8), (frames, size, size, 1))
        y = rng.randrange(0, size - 16)
        for f in range(frames):
            x = (4 * f + 8 * i) % (size - 16)
            arr[f, y : y + 16, x : x + 16] = 255
        write_mp4(folder / f"{i:02d}_{name}.mp4", arr, fps=8)
        (folder / f"{i:02d}_{name}.caption").write_text(
            f"a white square moving over a {name} background", encoding="utf-8"
        )
    return folder


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


def run_quickstart(out: Path, steps: int | None = None, seed: int = 0, family: str | None = None) -> QuickstartResult:
    from ..families.registry import DEFAULT_FAMILY

    family = family or DEFAULT_FAMILY
    recipe, family_sets = _flow_sets(family)
    out = Path(out)
    res = QuickstartResult(out)
    t = time.time()

    def lap(name: str) -> None:
        nonlocal t
        res.seconds[name] = time.time() - t
        t = time.time()

    data, model, meta = out / "data", out / "model", out / "metadata.json"
    fam = get_family(family)
    video = fam.video
    if video:
        if not (data.is_dir() and any(data.glob("*.mp4"))):
            make_clips(data, seed=seed)
    elif not (data.is_dir() and any(data.glob("*.png"))):
        make_dataset(data, seed=seed)
    if not (model / "model_index.json").exists():
        fam.build_tiny(model, seed=seed)
    lap("data and tiny model")
    sets = [
        *family_sets,
        f"model.path={model}",
        f"data.dir={data}",
        f"data.cache_dir={out / 'cache'}",
        f"train.output_dir={out / 'run'}",
    ]
    if video:  # the trainer's own validation sample (an image family's is its stock pipeline with the LoRA loaded)
        sets += [f"validation.prompts=[{CLIP_PROMPT}]", "validation.num_inference_steps=4"]
    else:  # WD14-style tags merged into metadata (merge-tags reads images)
        report = merge_tags(data, meta, tag_ext=".txt", caption_ext=".caption")
        info(f"merge-tags: {report.images} images, {report.with_tags} with tags -> {meta}")
        lap("merge-tags")
        sets += [f"data.metadata={meta}", "data.caption_source=caption_and_tags"]
    if fam.references:  # edit training: two references per target (mirrored, grey) in a control folder beside
        sets.append(f"data.control_dir={make_controls(data, out / 'control')}")
    if fam.image_conditioned and not fam.references:  # image-to-video's start frame (edit: the sample's references)
        from PIL import Image

        start = out / "start.png"
        if not start.exists():
            Image.new("RGB", (64, 64), COLOURS["red"]).save(start)
        sets.append(f"validation.images=[{start}]")
    if steps:
        sets.append(f"train.max_steps={steps}")
    resolved = resolve(recipe=recipe, sets=sets)
    cfg = resolved.config
    pre = precompute(cfg)
    what = "clips" if video else "latents"
    info(
        f"precompute: {pre.latents_encoded} {what} and {pre.texts_encoded} captions encoded, "
        f"{pre.latents_reused + pre.texts_reused} reused"
    )
    lap("precompute")
    tr = train(cfg, config_yaml=resolved.to_yaml(), overwrite=True)  # a rerun trains afresh over the reused cache
    res.losses = tr.losses
    lap("train")
    res.outputs.update({"data": data, "model": model})
    if not video:
        res.outputs["metadata"] = meta
    res.outputs.update({"cache": out / "cache", "run": out / "run", "lora": tr.lora_path})
    if video:
        final = out / "run" / "samples" / "final" / "00.mp4"
        res.outputs["sample"] = final if final.exists() else None
    else:
        refs = sorted((out / "control").glob("*.png"))[:2] if fam.references else None
        res.outputs["sample"] = sample(cfg, out / "run" / LORA_FILE, out / "sample.png", prompt=PROMPT, images=refs)
    lap("sample")
    return res


def sample(
    cfg, lora: Path, dest: Path, prompt: str, steps: int = 10, seed: int = 0, images: list[Path] | None = None
) -> Path:
    """One image from the family's stock diffusers pipeline with the exported LoRA loaded (``images``: an edit
    family's references)."""
    import torch

    from ..data.sources import load_rgb

    family = get_family(cfg.family)
    # on the CPU, every family's default (named: ModelFamily.load declares none)
    comps = family.load(cfg.model, list(family.parts), dtype=torch.float32, device="cpu")
    pipe = family.pipeline(comps, cfg.model)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    pipe.set_progress_bar_config(disable=True)
    size = cfg.data.resolution
    extra = {"image": family.validation_image([load_rgb(p) for p in images], size, cfg.model)} if images else {}
    image = pipe(
        prompt=prompt,
        num_inference_steps=steps,
        height=size,
        width=size,
        generator=torch.Generator().manual_seed(seed),
        **extra,
    ).images[0]
    image.save(dest)
    return dest
