"""Validation samples during training: fixed prompts, fixed seed, so samples compare across steps and runs.

Training loads only the denoiser (and trained text encoders). For a
validation round the VAE and the frozen text encoders are loaded (T5 at its
precompute precision), the family's diffusers pipeline runs over them and the
denoiser being trained (its LoRA active), the samples are written as PNG
(images) or mp4 (video families, at ``validation.fps``) under
``<output_dir>/samples/<tag>/``, and the extra parts are freed. GPU memory
before and after each round goes into stats.json.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from ..console import info
from ..errors import UsageError
from ..families.base import stage_precisions


def validate(trainer, tag: str) -> list[Path]:
    cfg, fam = trainer.cfg, trainer.family
    v = cfg.validation
    i2v = getattr(fam, "image_conditioned", False)
    if i2v and not v.images:
        raise UsageError("validation samples for image-to-video need a start image per prompt.",
                         hint="Set validation.images to one image file per validation prompt.")
    parts = [fam.image_encoder] + [p for s in fam.enabled_stages(cfg.text_encoders) for p in fam.text_stages[s]]
    missing = [p for p in dict.fromkeys(parts) if p not in trainer.comps]
    precision = stage_precisions(fam, cfg.text_encoders, fam.enabled_stages(cfg.text_encoders))
    dev = trainer.device
    extra = fam.load(cfg.model, missing, dtype=trainer.compute_dtype, device=dev, precision=precision) if missing else {}
    comps = {**trainer.comps, **extra}
    pipe = fam.pipeline(comps, cfg.model)
    pipe.set_progress_bar_config(disable=True)
    side = v.resolution or cfg.data.resolution
    folder = Path(cfg.train.output_dir) / "samples" / tag
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    denoiser = comps[fam.denoiser]
    was_training = denoiser.training
    denoiser.eval()
    amp = trainer.amp_dtype
    try:
        with torch.no_grad(), torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
            for i, prompt in enumerate(v.prompts):
                g = torch.Generator(device=dev).manual_seed(v.seed + i)
                kw = dict(prompt=prompt, num_inference_steps=v.num_inference_steps, guidance_scale=v.guidance_scale,
                          height=side, width=side, generator=g)
                if i2v:
                    from ..data.sources import load_rgb

                    kw["image"] = load_rgb(v.images[i]).resize((side, side))
                if getattr(fam, "video", False):
                    frames = pipe(num_frames=cfg.data.frames, output_type="np", **kw).frames[0]
                    from ..data.video import write_mp4

                    out.append(write_mp4(folder / f"{i:02d}.mp4", frames, v.fps))
                else:
                    image = pipe(**kw).images[0]
                    path = folder / f"{i:02d}.png"
                    image.save(path)
                    out.append(path)
    finally:
        denoiser.train(was_training)
        del pipe, comps, extra
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    info(f"validation: {len(out)} sample(s) in {folder}")
    return out
