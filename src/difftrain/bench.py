"""difftrain bench memory: a config's peak memory and step time on random data of the real shapes.

The model is a random-weight copy of the bundled architecture (or the
config's own model), the cache holds random latents and embeddings of the
shapes precompute would write at the config's resolution, and the config
trains for a few steps. Reported beside the planner's prediction, so a user
can check a recipe on their own GPU before preparing any data.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config.schema import Config
from .data.cache import DataCache
from .families.registry import get_family
from .families.tokenizers import tiny_clip_vocab
from .trainers.loop import Trainer, plan_memory
from .utils import pick_device


@dataclass
class BenchResult:
    peak_after_load_gib: float | None
    peak_train_alloc_gib: float | None
    peak_train_reserved_gib: float | None
    s_per_step: float
    planned_alloc_gib: float
    planned_reserved_gib: float
    stats: dict = field(default_factory=dict)


def synthetic_tokenizers(folder: Path) -> Path:
    """Offline stand-ins for the CLIP tokenizers a single file lacks (ids fit any CLIP vocabulary)."""
    if not (folder / "tokenizer_2").exists():
        tiny_clip_vocab(folder / "tokenizer")
        tiny_clip_vocab(folder / "tokenizer_2", pad_token="!")
    return folder


def synthetic_cache(cfg: Config, root: Path, n: int = 4, size: tuple[int, int] | None = None) -> Path:
    """``size`` (height, width): a non-square shape (CogVideoX's 480x720); default the square resolution."""
    family = get_family(cfg.family)
    video = {"frames": cfg.data.frames} if getattr(family, "video", False) else {}
    shapes = family.cache_shapes(cfg.model.config, size or cfg.data.resolution, **video)
    cache = DataCache(root)
    g = torch.Generator().manual_seed(0)
    items = []
    side = cfg.data.resolution
    for i in range(n):
        lat = {k: torch.zeros(v, dtype=torch.int64) if k == "crop" else torch.randn(v, generator=g)
               for k, v in shapes["latent"].items()}
        cache.put(f"lat{i}", lat)
        texts = {}
        for stage in family.enabled_stages(cfg.text_encoders):
            cache.put(f"{stage}{i}", {k: torch.randn(v, generator=g) for k, v in shapes[stage].items()})
            texts[stage] = f"{stage}{i}"
        items.append({"key": f"img{i}", "image": f"img{i}.png", "caption": f"a photo of a cat, number {i}",
                      "bucket": [side, side], "original_size": [side, side], "latent": f"lat{i}", "texts": texts})
    cache.flush()
    cache.write_json("index.json", {"family": family.name, "items": items})
    return root


def bench_memory(cfg: Config, work: Path, steps: int = 6, size: tuple[int, int] | None = None) -> BenchResult:
    work = Path(work)
    family = get_family(cfg.family)
    device = pick_device(cfg.train.device)
    update: dict = {}
    if cfg.model.path is None:
        from .trainers.loop import plan_parts

        parts = plan_parts(cfg, family)[0]  # only what training loads (SD3's T5 alone is 4.7 B parameters)
        path = work / f"random-{cfg.model.config}-{'-'.join(parts)}.safetensors"
        if not path.exists():
            family.build_random(cfg.model.config, path, device=device, parts=parts)
            if device.type == "cuda":  # the stand-in was built on the GPU: give its blocks back before measuring
                import gc

                gc.collect()
                torch.cuda.empty_cache()
        tok = synthetic_tokenizers(work / "tokenizers")
        update["model"] = cfg.model.model_copy(update={"path": path, "tokenizer_path": tok})
    tag = f"{size[0]}x{size[1]}" if size else str(cfg.data.resolution)
    cache_dir = synthetic_cache(cfg, work / f"cache-{tag}-{cfg.data.frames}", size=size)
    update["data"] = cfg.data.model_copy(update={"cache_dir": cache_dir})
    update["train"] = cfg.train.model_copy(update={"max_steps": steps, "output_dir": work / "run", "checkpoint_every": None,
                                                   "device": str(device)})
    update["save"] = cfg.save.model_copy(update={"formats": []})
    run_cfg = cfg.model_copy(update=update)
    plan = plan_memory(run_cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(run_cfg)
    result = trainer.run()
    times = [r["time"] for r in _metrics(work / "run" / "metrics.jsonl")][-steps:]
    per_step = [b - a for a, b in zip(times, times[1:])][1:] or [result.seconds / max(1, steps)]
    s = result.stats
    return BenchResult(
        peak_after_load_gib=s.get("gpu_alloc_gib_after_load"),
        peak_train_alloc_gib=s.get("gpu_peak_alloc_gib"),
        peak_train_reserved_gib=s.get("gpu_peak_reserved_gib"),
        s_per_step=round(statistics.median(per_step), 3),
        planned_alloc_gib=round(plan.gpu_total, 2),
        planned_reserved_gib=round(plan.gpu_reserved, 2),
        stats=s,
    )


def _metrics(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]
