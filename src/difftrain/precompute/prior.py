"""DreamBooth class images: use the ones supplied, generate the missing ones with the base model.

Generation runs once, before encoding: the family's diffusers pipeline on the
base model draws ``num_class_images - present`` images of ``class_prompt``,
each from its own seed (train.seed + its index), so a rerun that finds some
missing makes the same ones. Each PNG is written to a temporary name and
renamed, so an interrupted run leaves no half-written image.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..config.schema import Config
from ..console import info, progress
from ..data.paths import list_images
from ..families.base import ModelFamily, stage_precisions
from ..utils import free_memory


def ensure_class_images(cfg: Config, family: ModelFamily, device: torch.device) -> Path:
    db = cfg.dreambooth
    assert db.class_data_dir is not None  # the config's validator requires it with prior preservation
    folder = Path(db.class_data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    present = len(list_images(folder, True))
    missing = db.num_class_images - present
    if missing <= 0:
        return folder
    info(f"dreambooth: generating {missing} class image(s) of {db.class_prompt!r} into {folder}")
    parts = [family.denoiser, family.image_encoder, *family.text_encoders]
    precision = stage_precisions(family, cfg.text_encoders, family.enabled_stages(cfg.text_encoders))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    comps = family.load(cfg.model, parts, dtype=dtype, device=device, precision=precision)
    pipe = family.pipeline(comps, cfg.model)
    side = cfg.data.resolution
    with progress() as bar, torch.no_grad():
        task = bar.add_task("class images", total=missing)
        for k in range(missing):
            i = present + k
            g = torch.Generator(device=device).manual_seed(cfg.train.seed + i)
            image = pipe(
                prompt=db.class_prompt, num_inference_steps=db.class_sample_steps, height=side, width=side, generator=g
            ).images[0]
            path = folder / f"class-{i:05d}.png"
            tmp = folder / f".class-{i:05d}.png.tmp"
            image.save(tmp, format="PNG")
            os.replace(tmp, path)
            bar.advance(task)
    del pipe, comps
    free_memory(device)
    return folder
