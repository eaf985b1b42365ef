"""difftrain lora merge | resize"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..console import console, info

app = typer.Typer(help="Bake a LoRA into a checkpoint, or change its rank.", no_args_is_help=True)


class Precision(str, Enum):
    fp16 = "fp16"
    bf16 = "bf16"
    fp32 = "fp32"


OutOpt = Annotated[Path, typer.Option("--out", "-o", help="the .safetensors file to write")]


@app.command("merge")
def merge(
    base: Annotated[
        Path, typer.Argument(help="the base model: a single-file .safetensors checkpoint or a diffusers folder")
    ],
    lora: Annotated[Path, typer.Argument(help="a LoRA .safetensors file, diffusers or kohya layout")],
    out: OutOpt,
    scale: Annotated[float, typer.Option("--scale", help="multiplies the LoRA's change to each weight")] = 1.0,
    # a name, checked by lora merge against the families that can be merged (the registry's; no choice list here,
    # which would import every family, and torch, to show --help)
    family: Annotated[
        str | None, typer.Option("--family", help="a family that can be merged (default: told from the base model)")
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="bundled architecture of a single-file base (default: sdxl-base-1.0, or the SD3 one its keys match)",
        ),
    ] = None,
    precision: Annotated[Precision | None, typer.Option("--precision", help="default: the base's stored dtype")] = None,
) -> None:
    """Merge a LoRA into its base model's weights (W += scale * alpha/rank * up @ down) and write one single file."""
    from ..lora.tools import merge as run

    r = run(
        base,
        lora,
        out,
        scale=scale,
        family=family,
        config=config,
        precision=precision.value if precision else None,
    )
    layers = ", ".join(f"{n} {part}" for part, n in r.layers.items())
    info(
        f"merged {r.layout} LoRA ({layers} layers, scale {scale:g}) into the {r.family} base: {r.path} "
        f"({str(r.dtype).removeprefix('torch.')})"
    )


@app.command("resize")
def resize(
    lora: Annotated[Path, typer.Argument(help="a LoRA .safetensors file, diffusers or kohya layout")],
    out: OutOpt,
    rank: Annotated[
        int | None, typer.Option("--rank", help="the new rank (with --energy: the largest allowed)")
    ] = None,
    energy: Annotated[
        float | None,
        typer.Option(
            "--energy",
            help="per layer, the smallest rank keeping this fraction "
            "of ΔW's sum of squared singular values (sd-scripts' sv_fro, squared)",
        ),
    ] = None,
) -> None:
    """Change a LoRA's rank by truncated SVD of each layer's ΔW; print the energy each layer keeps."""
    from ..lora.tools import resize as run

    r = run(lora, out, rank=rank, energy=energy)
    t = Table(title=f"lora resize: {lora.name} -> {out.name}")
    t.add_column("layer", style="cyan")
    t.add_column("rank", justify="right")
    t.add_column("new rank", justify="right")
    t.add_column("energy kept", justify="right")
    for row in r.layers:
        t.add_row(row.name, str(row.rank), str(row.new_rank), f"{row.energy:.2%}")
    console.print(t)
    low = r.min
    info(
        f"{len(r.layers)} layers: energy kept {r.overall:.2%} overall, mean {r.mean:.2%}, min {low.energy:.2%} ({low.name}); "
        f"wrote {r.path} ({r.layout} layout)"
    )
