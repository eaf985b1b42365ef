"""difftrain merge-tags and difftrain precompute."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from typing_extensions import Annotated

from ..console import console, info
from .common import print_config, resolved_config
from .options import AllowPickleOpt, ConfigOpt, DataDirOpt, ModelOpt, PrintConfigOpt, RecipeOpt, SetOpt, shortcuts


def merge_tags(
    data_dir: Annotated[Path, typer.Argument(help="folder of images with tag and caption files")],
    out_json: Annotated[Path, typer.Argument(help="metadata JSON to write (sd-scripts finetune layout)")],
    tag_ext: Annotated[str, typer.Option("--tag-ext", help="extension of WD14-style tag files")] = ".txt",
    caption_ext: Annotated[str, typer.Option("--caption-ext", help="extension of caption files")] = ".caption",
    in_json: Annotated[Optional[Path], typer.Option("--in-json", help="existing metadata to update (other fields are kept)")] = None,
    full_path: Annotated[bool, typer.Option("--full-path", help="key images by full path, as sd-scripts does")] = False,
    recursive: Annotated[bool, typer.Option("--recursive", help="look in subfolders too")] = False,
) -> None:
    """Merge tag files and captions into one metadata JSON."""
    from ..data.tags import merge_tags as run

    r = run(data_dir, out_json, tag_ext=tag_ext, caption_ext=caption_ext, in_json=in_json, full_path=full_path, recursive=recursive)
    info(f"{r.images} images: {r.with_tags} with tags, {r.with_caption} with captions -> {r.out_path}")
    if r.missing_tags:
        info(f"[yellow]{len(r.missing_tags)} without a tag file[/yellow] (e.g. {', '.join(r.missing_tags[:5])})")
    if r.missing_captions:
        info(f"{len(r.missing_captions)} without a caption file")


def precompute(
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    data_dir: DataDirOpt = None,
    model: ModelOpt = None,
    allow_pickle: AllowPickleOpt = False,
    strict: Annotated[bool, typer.Option("--strict", help="fail if any image cannot be used")] = False,
    print_config_: PrintConfigOpt = False,
    gpus: Annotated[int, typer.Option("--gpus", help="processes (GPUs) sharing the encoding, started through torchrun")] = 1,
) -> None:
    """Cache aspect buckets, VAE latents and text embeddings once, keyed by content."""
    import os

    from ..console import quiet_rank
    from ..precompute.run import precompute as run

    res = resolved_config(recipe, config, set_, shortcuts(data_dir, model, allow_pickle))
    if print_config_:
        print_config(res)
        return
    if gpus > 1 and "LOCAL_RANK" not in os.environ:
        from ..distributed import launch
        from .common import invoked_argv

        launch(gpus, invoked_argv())
        info(f"precomputed on {gpus} processes")
        return
    r = run(res.config, strict=strict)
    if quiet_rank():
        return
    table = Table(title=f"buckets ({r.items} images)")
    table.add_column("bucket (w x h)")
    table.add_column("images", justify="right")
    for b, n in sorted(r.buckets.items()):
        table.add_row(b, str(n))
    console.print(table)
    info(
        f"latents: {r.latents_encoded} encoded, {r.latents_reused} reused from cache; "
        f"captions: {r.texts_encoded} encoded, {r.texts_reused} reused; "
        f"{len(r.skipped)} skipped -> {r.cache_dir}"
    )
