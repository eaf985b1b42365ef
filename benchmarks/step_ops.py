"""Operators one eager training step dispatches: difftrain's step against a plain diffusers+peft loop (issue 24,
"eager no slower than plain diffusers"). On a GPU each dispatched operator is about one kernel launch, and an
SDXL step at batch 1 is bound by the host launching them, so extra operators per step are extra time. Runs on
the CPU with the tiny SDXL (no GPU needed): the same techniques as sdxl-lora-8gb (LoRA r16 on the attention
projections, checkpointing, AdamW, gradient clipping, noise offset, min-SNR).

    python benchmarks/step_ops.py [--family sd3] [--work DIR] [--set key=value ...]

--family sd3: the tiny SD3 with sd3-lora-8gb's techniques (LoRA r16 on both streams' attention projections,
checkpointing, AdamW, clipping) against the plain SD3 loop of fast_default.py (flow matching, uniform sigmas).

Prints both counts per step and the operators whose counts differ, most first.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.c: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.c[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


SETS = [
    "lora.rank=16",
    "lora.alpha=16",
    "lora.targets=[to_q, to_k, to_v, to_out.0]",
    "memory.activations.kind=checkpoint",
    "train.batch_size=1",
    "train.noise_offset=0.0357",
    "train.min_snr_gamma=5.0",
    "speed.compile=false",
    "train.lr_scheduler=constant_with_warmup",
    "train.warmup_steps=100",
]


SD3_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
SD3_SETS = [
    "lora.rank=16",
    "lora.alpha=16",
    f"lora.targets=[{', '.join(SD3_TARGETS)}]",
    "memory.activations.kind=checkpoint",
    "train.batch_size=1",
    "speed.compile=false",
]


def difftrain_step(work: Path, sets: list[str], family: str = "sdxl") -> tuple[collections.Counter, object]:
    from difftrain.config.load import resolve
    from difftrain.flows.bench import _prepare
    from difftrain.trainers.loop import Trainer

    recipe, base = ("tiny-sd3-lora", SD3_SETS) if family == "sd3" else ("tiny-sdxl-lora", SETS)
    cfg = _prepare(resolve(recipe=recipe, sets=base + sets).config, work / family, 5, None)
    counts: list[collections.Counter] = []
    real = Trainer._micro_batch

    def counted(self, idx, acc):
        m = Count()
        with m:
            r = real(self, idx, acc)
        counts.append(m.c)
        return r

    Trainer._micro_batch = counted  # type: ignore[method-assign]
    try:
        trainer = Trainer(cfg)
        trainer.run()
    finally:
        Trainer._micro_batch = real  # type: ignore[method-assign]
    return counts[3], trainer


def _plain_counts(model, targets: list[str], loss_of) -> collections.Counter:
    """The plain loops' shared part: ``model`` frozen with diffusers' checkpointing, LoRA r16 (peft) on ``targets``,
    AdamW; the operators of the fourth step (``loss_of()``, backward, the optimizer step, a ``.item()``)."""
    from peft import LoraConfig

    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=targets))
    # foreach: what AdamW picks on CUDA (the CPU default is its for-loop); difftrain takes foreach here, fused on CUDA
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    counts = []
    for _ in range(4):
        m = Count()
        with m:
            loss = loss_of()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
        counts.append(m.c)
    return counts[3]


def plain_step(trainer) -> collections.Counter:
    from diffusers import UNet2DConditionModel

    ucfg = trainer.parts.comps["unet"].config
    unet = UNet2DConditionModel.from_config(ucfg)
    lat = trainer.feed.batch([trainer.feed.items[0]], 0)["latents"]
    pooled = ucfg.projection_class_embeddings_input_dim - 6 * ucfg.addition_time_embed_dim

    def loss_of():
        x = torch.randn_like(lat)
        enc = torch.randn(1, 77, ucfg.cross_attention_dim)
        added = {"text_embeds": torch.randn(1, pooled), "time_ids": torch.tensor([[128.0, 128, 0, 0, 128, 128]])}
        pred = unet(x, torch.randint(0, 1000, (1,)), encoder_hidden_states=enc, added_cond_kwargs=added).sample
        return torch.nn.functional.mse_loss(pred.float(), x.float())

    return _plain_counts(unet, ["to_q", "to_k", "to_v", "to_out.0"], loss_of)


def plain_sd3_step(trainer) -> collections.Counter:
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel.from_config(trainer.parts.comps["transformer"].config)
    b = trainer.feed.batch([trainer.feed.items[0]], 0)

    def loss_of():
        x0 = b["latents"]
        noise = torch.randn_like(x0)
        sig = torch.rand(1)
        xt = (1 - sig) * x0 + sig * noise
        pred = model(
            hidden_states=xt,
            encoder_hidden_states=torch.randn_like(b["prompt_embeds"]),
            pooled_projections=torch.randn_like(b["pooled_prompt_embeds"]),
            timestep=sig * 1000,
            return_dict=False,
        )[0]
        return torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())

    return _plain_counts(model, SD3_TARGETS, loss_of)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-step-ops"))
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--family", choices=["sdxl", "sd3"], default="sdxl")
    a = ap.parse_args()
    dt, trainer = difftrain_step(a.work, a.sets, a.family)
    pp = plain_sd3_step(trainer) if a.family == "sd3" else plain_step(trainer)
    print(f"operators per step: difftrain {sum(dt.values())}, plain diffusers+peft {sum(pp.values())}")
    diff = {k: dt[k] - pp[k] for k in set(dt) | set(pp) if dt[k] != pp[k]}
    for k, v in sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0])):
        print(f"  {k:45s} difftrain {dt[k]:6d}  plain {pp[k]:6d}  {v:+d}")


if __name__ == "__main__":
    main()
