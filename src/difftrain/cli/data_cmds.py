"""difftrain merge-tags and difftrain precompute."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from ..console import console, info
from .common import print_config, resolved_config, with_hub_model
from .options import (
    AllowPickleOpt,
    ConfigOpt,
    DataDirOpt,
    DatasetConfigOpt,
    ModelOpt,
    PrintConfigOpt,
    RecipeOpt,
    SetOpt,
    shortcuts,
)

if TYPE_CHECKING:  # an annotation only: data.tags loads torch (through utils), which the CLI imports when it runs
    from ..data.tags import MergeReport
    from ..precompute.run import PrecomputeReport


def merge_tags(
    data_dir: Annotated[Path, typer.Argument(help="folder of images with tag and caption files")],
    out_json: Annotated[Path, typer.Argument(help="metadata JSON to write (sd-scripts finetune layout)")],
    tag_ext: Annotated[str, typer.Option("--tag-ext", help="extension of WD14-style tag files")] = ".txt",
    caption_ext: Annotated[str, typer.Option("--caption-ext", help="extension of caption files")] = ".caption",
    in_json: Annotated[
        Path | None, typer.Option("--in-json", help="existing metadata to update (other fields are kept)")
    ] = None,
    full_path: Annotated[bool, typer.Option("--full-path", help="key images by full path, as sd-scripts does")] = False,
    recursive: Annotated[bool, typer.Option("--recursive", help="look in subfolders too")] = False,
    drop_tags: Annotated[
        list[str] | None,
        typer.Option("--drop-tags", help="unwanted tags: a comma list, or a file of them (repeatable)"),
    ] = None,
    threshold: Annotated[
        float | None, typer.Option("--threshold", help="drop tags whose score (tag:0.83, or WD14 CSV) is below this")
    ] = None,
    underscores_to_spaces: Annotated[
        bool, typer.Option("--underscores-to-spaces", help="long_hair -> long hair (kaomoji such as ^_^ kept)")
    ] = False,
    ratings: Annotated[
        str,
        typer.Option(
            "--ratings", help="keep | drop WD14's rating tags (general, sensitive, questionable, explicit, rating:*)"
        ),
    ] = "keep",
    keep_duplicates: Annotated[bool, typer.Option("--keep-duplicates", help="do not remove repeated tags")] = False,
    caption_from: Annotated[
        str | None, typer.Option("--caption-from", help="tags | caption | both: what the caption field holds")
    ] = None,
    separator: Annotated[
        str, typer.Option("--separator", help="between caption and tags with --caption-from both")
    ] = ", ",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would change; write nothing")] = False,
    allow_outside_paths: Annotated[
        bool, typer.Option("--allow-outside-paths", help="follow links to files outside the folder")
    ] = False,
) -> None:
    """Merge tag files and captions into one metadata JSON."""
    from ..data.tags import TagRules, read_drop_list
    from ..data.tags import merge_tags as run

    rules = TagRules(
        drop=read_drop_list(drop_tags or []),
        dedupe=not keep_duplicates,
        threshold=threshold,
        underscores=underscores_to_spaces,
        ratings=ratings,
        caption_from=caption_from,
        separator=separator,
    )
    r = run(
        data_dir,
        out_json,
        tag_ext=tag_ext,
        caption_ext=caption_ext,
        in_json=in_json,
        full_path=full_path,
        recursive=recursive,
        rules=rules,
        dry_run=dry_run,
        allow_outside=allow_outside_paths,
    )
    _print_merge(r, dry_run)


def _print_merge(r: MergeReport, dry_run: bool) -> None:
    """What merge-tags did, or with ``dry_run`` would do."""
    from rich.markup import escape

    if dry_run:
        for key, before, after in r.changes[:20]:
            for field_ in ("caption", "tags"):
                if before.get(field_) != after.get(field_):
                    info(f"{key} {field_}: {before.get(field_)!r} -> {after.get(field_)!r}")
        info(
            f"dry run: {len(r.changes)} of {r.images} entries would change, {r.tags_removed} tags removed; "
            f"{r.out_path} not written"
        )
        return
    info(
        f"{r.images} images: {r.with_tags} with tags, {r.with_caption} with captions, {r.tags_removed} tags removed "
        f"-> {r.out_path}"
    )
    if r.missing_tags:
        info(
            f"[yellow]{len(r.missing_tags)} without a tag file[/yellow] (e.g. {escape(', '.join(r.missing_tags[:5]))})",
            markup=True,
        )
    if r.missing_captions:
        info(f"{len(r.missing_captions)} without a caption file")
    _say_unused(r.unused)


def _say_unused(unused: list) -> None:
    """Files with image or video extensions that the dataset leaves out, counted by extension, the first named."""
    if not unused:
        return
    from collections import Counter

    from rich.markup import escape

    by_ext = Counter(p.suffix.lower() for p, _ in unused)
    kinds = ", ".join(f"{n} {ext}" for ext, n in sorted(by_ext.items()))
    path, why = unused[0]
    info(
        f"[yellow]{len(unused)} files not used[/yellow] ({escape(kinds)}), e.g. {escape(str(path))}: {escape(why)}",
        markup=True,
    )


def _print_subsets(r: PrecomputeReport) -> None:
    """The folders read, when there are several (kohya's layout, data.subsets, data.reg_dir): their repeats, images
    and where their captions came from."""
    if not r.subsets:
        return
    origins = sorted({s.origin for s in r.subsets})
    table = Table(title=f"subsets ({', '.join(origins)})")
    for col in ("subset", "kind", "repeats", "images", "per epoch", "captions from"):
        table.add_column(col, justify="right" if col in ("repeats", "images", "per epoch") else "left")
    for s in r.subsets:
        sources = ", ".join(f"{origin} {n}" for origin, n in sorted(s.captions.items(), key=lambda kv: -kv[1]))
        per_epoch = "beside batches" if s.is_reg else str(s.images * s.repeats)
        kind = "regularisation" if s.is_reg else "training"
        table.add_row(s.name, kind, str(s.repeats), str(s.images), per_epoch, sources or "-")
    console.print(table)
    if "kohya layout" in origins:
        info(
            "data.dir is read in kohya's layout: each <repeats>_<name> folder is seen <repeats> times an epoch, and "
            "its name is the caption of an image with no caption or tag file (data.layout: folder reads it plainly)"
        )


def _print_masks(r, plan: bool = False) -> None:
    """Masked loss: where the items' masks come from, and (in a plan) each item without one."""
    if not r.masks:
        return
    learned = " (learned everywhere)" if r.masks.get("none") else ""
    encoded = "" if plan else f"; {r.masks_encoded} fitted, the rest reused"
    info("masks: " + ", ".join(f"{kind} {n}" for kind, n in sorted(r.masks.items())) + learned + encoded)
    if plan:
        for path, why in r.unmasked:
            info(f"no mask for {path}: {why}")
    if r.colour_masks:
        info(
            f"{len(r.colour_masks)} mask(s) in colour, their red channel read (as sd-scripts), e.g. {r.colour_masks[0]}"
        )


def precompute(
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    data_dir: DataDirOpt = None,
    dataset_config: DatasetConfigOpt = None,
    model: ModelOpt = None,
    allow_pickle: AllowPickleOpt = False,
    strict: Annotated[bool, typer.Option("--strict", help="fail if any image cannot be used")] = False,
    print_config_: PrintConfigOpt = False,
    gpus: Annotated[
        int, typer.Option("--gpus", help="processes (GPUs) sharing the encoding, started through torchrun")
    ] = 1,
    plan_only: Annotated[
        bool, typer.Option("--plan-only", help="print the bucket table and what is dropped and why; encode nothing")
    ] = False,
) -> None:
    """Cache aspect buckets, VAE latents and text embeddings once, keyed by content."""
    import os

    from ..console import quiet_rank
    from ..precompute.run import precompute as run

    res = resolved_config(recipe, config, set_, shortcuts(data_dir, model, allow_pickle, dataset_config))
    if print_config_:
        print_config(res)
        return
    if plan_only:
        r = run(res.config, plan_only=True)
        table = Table(title=f"bucket plan ({r.items} usable, {len(r.skipped)} dropped)")
        for col in ("bucket (w x h)", "images", "share"):
            table.add_column(col, justify="left" if col.startswith("bucket") else "right")
        for b, n in sorted(r.buckets.items(), key=lambda kv: -kv[1]):
            table.add_row(b, str(n), f"{n / max(1, r.items):.1%}")
        console.print(table)
        _print_subsets(r)
        _print_masks(r, plan=True)
        for path, why in r.skipped:
            info(f"dropped {path}: {why}")
        return
    with_hub_model(res)  # before the processes start: they find it in the cache
    if gpus > 1 and "LOCAL_RANK" not in os.environ:
        from ..runtime.distributed import launch
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
    _print_subsets(r)
    info(
        f"latents: {r.latents_encoded} encoded, {r.latents_reused} reused from cache; "
        f"captions: {r.texts_encoded} encoded, {r.texts_reused} reused; "
        f"{len(r.skipped)} skipped -> {r.cache_dir}"
    )
    _print_masks(r)
    if r.converted:
        info("converted to RGB: " + ", ".join(f"{n} {mode}" for mode, n in sorted(r.converted.items())))
    if set(r.captions) - {"caption"}:
        info(
            "captions from: "
            + ", ".join(f"{origin} {n}" for origin, n in sorted(r.captions.items(), key=lambda kv: -kv[1]))
        )
    if r.skipped and r.report_file:
        info(f"every skipped file and its reason: {r.report_file}")
