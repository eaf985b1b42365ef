"""Validation samples during training: fixed prompts, fixed seed, so samples compare across steps and runs.

Training loads only the denoiser (and trained text encoders). For a
validation round the VAE and the frozen text encoders are loaded (T5 at its
precompute precision), the family's diffusers pipeline runs over them and the
denoiser being trained (its LoRA active), the samples are written as PNG
(images) or mp4 (video families, at ``validation.fps``) under
``<output_dir>/samples/<tag>/``, and the extra parts are freed. GPU memory
before and after each round goes into stats.json.

``validation.cpu_offload``: the extra parts load on the CPU and each moves to
the GPU only for its own calls (model CPU offload, see :func:`_offload_extras`),
so at most one of them sits beside the training state at a time; T5 then runs
in bf16, since bitsandbytes-quantized weights cannot move between devices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config.schema import Config, ValidationConfig
from ..console import info
from ..errors import UsageError
from ..families.base import ModelFamily, stage_precisions
from ..utils import free_memory

if TYPE_CHECKING:
    from .feed import Feed


@dataclass(frozen=True)
class ValidationInputs:
    """What a validation round needs from the run: the parts it loaded (the denoiser being trained among
    them), where they live and the precisions it computes in."""

    cfg: Config
    family: ModelFamily
    comps: dict[str, Any]
    device: torch.device
    compute_dtype: torch.dtype
    amp_dtype: torch.dtype | None


#: the loss of a micro-batch at fixed (noise, noise level): Trainer.loss
LossAt = Callable[..., torch.Tensor]


@torch.no_grad()
def held_out_loss(
    loss: LossAt, feed: Feed, denoiser: torch.nn.Module, v: ValidationConfig, device: torch.device
) -> float | None:
    """Mean loss over the held-out items, each at ``validation.loss_timesteps`` fixed noise levels (the
    quantiles (k + 1/2) / K) with noise drawn on the CPU from a seed per item: the same triples on every
    call, device and trial, so two evaluations of the same weights agree and trials compare."""
    if not feed.val_items:
        return None
    was = denoiser.training
    denoiser.eval()
    total, n = 0.0, 0
    try:
        for j, item in enumerate(feed.val_items):
            batch = feed.batch([item])
            g = torch.Generator().manual_seed(v.seed * 1_000_003 + j)
            for k in range(v.loss_timesteps):
                noise = torch.randn(batch["latents"].shape, generator=g).to(device)
                q = torch.full((1,), (k + 0.5) / v.loss_timesteps, device=device)
                total += loss(batch, fixed=(noise, q)).item()
                n += 1
    finally:
        denoiser.train(was)
    return total / n


def check_inputs(cfg, family) -> None:
    """What a validation round will need, checked before anything loads: an image-to-video family's start images."""
    if family.image_conditioned and cfg.validation.prompts and not cfg.validation.images:
        raise UsageError(
            "validation samples for image-to-video need a start image per prompt.",
            hint="Set validation.images to one image file per validation prompt, or remove validation.prompts.",
        )


def validate(run: ValidationInputs, tag: str) -> list[Path]:
    cfg, fam = run.cfg, run.family
    v = cfg.validation
    i2v = fam.image_conditioned
    if i2v and not v.images:
        raise UsageError(
            "validation samples for image-to-video need a start image per prompt.",
            hint="Set validation.images to one image file per validation prompt.",
        )
    parts = [fam.image_encoder] + [p for s in fam.enabled_stages(cfg.text_encoders) for p in fam.text_stages[s]]
    missing = [p for p in dict.fromkeys(parts) if p not in run.comps]
    precision = stage_precisions(fam, cfg.text_encoders, fam.enabled_stages(cfg.text_encoders))
    dev = run.device
    load_on = "cpu" if v.cpu_offload else dev
    extra = (
        fam.load(cfg.model, missing, dtype=run.compute_dtype, device=load_on, precision=precision) if missing else {}
    )
    comps = {**run.comps, **extra}
    pipe = fam.pipeline(comps, cfg.model)
    offload = _offload_extras(pipe, extra, comps[fam.denoiser], dev) if v.cpu_offload else None
    pipe.set_progress_bar_config(disable=True)
    side = v.resolution or cfg.data.resolution
    folder = Path(cfg.train.output_dir) / "samples" / tag
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    denoiser = comps[fam.denoiser]
    was_training = denoiser.training
    denoiser.eval()
    amp = run.amp_dtype
    try:
        with torch.no_grad(), torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
            for i, prompt in enumerate(v.prompts):
                g = torch.Generator(device=dev).manual_seed(v.seed + i)
                kw = {
                    "prompt": prompt,
                    "num_inference_steps": v.num_inference_steps,
                    "guidance_scale": v.guidance_scale,
                    "height": side,
                    "width": side,
                    "generator": g,
                }
                if i2v:  # the start image (image-to-video) or the references (edit) of the prompt
                    from ..data.sources import load_rgb

                    given = v.images[i]
                    paths = given if isinstance(given, list) else [given]
                    kw["image"] = fam.validation_image([load_rgb(p) for p in paths], side, cfg.model)
                if fam.video:
                    frames = pipe(num_frames=cfg.data.frames, output_type="np", **kw).frames[0]
                    from ..data.video import write_mp4

                    out.append(write_mp4(folder / f"{i:02d}.mp4", frames, v.fps))
                else:
                    image = pipe(**kw).images[0]
                    path = folder / f"{i:02d}.png"
                    image.save(path)
                    out.append(path)
                if offload:
                    offload.offload_all()
    finally:
        if offload:
            offload.remove()
        denoiser.train(was_training)
        del pipe, comps, extra
        free_memory(dev)
    info(f"validation: {len(out)} sample(s) in {folder}")
    return out


class _Offload:
    def __init__(self, hooks: list, handle) -> None:
        self.hooks, self.handle = hooks, handle

    def offload_all(self) -> None:
        for h in self.hooks:
            h.offload()

    def remove(self) -> None:
        self.handle.remove()
        for h in self.hooks:
            h.remove()


def _offload_extras(pipe, extra: dict, denoiser: torch.nn.Module, dev: torch.device) -> _Offload:
    """Model CPU offload of the parts loaded for validation, in the pipeline's own order
    (``model_cpu_offload_seq``): each moves to ``dev`` when called and sends the one
    before it back (accelerate's ``cpu_offload_with_hook``, the mechanism of diffusers'
    ``enable_model_cpu_offload``), and the denoiser's first call sends them all back.

    Not ``pipe.enable_model_cpu_offload()`` itself: it first moves every part to the
    CPU, the denoiser being trained (its optimizer state, block-swap buffers, fp8
    weights) included, and hooks it; here the denoiser stays exactly where training
    keeps it.
    """
    from accelerate import cpu_offload_with_hook

    modules = {k: m for k, m in extra.items() if isinstance(m, torch.nn.Module)}
    order = [k for k in (pipe.model_cpu_offload_seq or "").split("->") if k in modules]
    order += [k for k in modules if k not in order]
    hooks, prev = [], None
    for name in order:
        _, prev = cpu_offload_with_hook(modules[name], dev, prev_module_hook=prev)
        hooks.append(prev)
    off = _Offload(hooks, None)

    def before_denoiser(module, args):
        for h in hooks:
            if next(h.model.parameters()).device.type != "cpu":
                h.offload()

    off.handle = denoiser.register_forward_pre_hook(before_denoiser)
    return off
