"""difftrain cache info | verify | prune"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..console import info

app = typer.Typer(help="Look after a precompute cache.", no_args_is_help=True)
CacheDir = Annotated[Path, typer.Argument(help="the cache folder (data.cache_dir, or <data dir>/.difftrain-cache)")]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _check(folder: Path) -> None:
    from ..errors import UsageError

    if not (folder / "manifest.json").is_file():
        raise UsageError(
            f"{folder} is not a difftrain cache (no manifest.json).", hint="Give the folder precompute wrote."
        )


@app.command("info")
def info_(folder: CacheDir) -> None:
    """Entries, shards, size, index items, and what the index does not use."""
    from ..data.cache import cache_info

    _check(folder)
    i = cache_info(folder)
    info(
        f"{i['root']}: {i['items']} items ({i['family']}), {i['entries']} entries in {i['shards']} shards, {_gib(i['bytes'])}; "
        f"{i['unused_entries']} entries unused by the index, {len(i['stray_files'])} stray files"
    )


@app.command("verify")
def verify(folder: CacheDir) -> None:
    """Read every shard's header and check every entry and index item; exit 1 on any problem."""
    from ..data.cache import verify_cache
    from ..errors import CacheMismatch

    _check(folder)
    problems = verify_cache(folder)
    for p in problems[:50]:
        info(f"problem: {p}")
    if problems:
        raise CacheMismatch(
            f"The cache at {folder} has {len(problems)} problem(s).",
            hint="Run `difftrain precompute` again: it re-encodes what is missing (after `difftrain cache prune`).",
        )
    info(f"{folder}: sound")


@app.command("prune")
def prune(
    folder: CacheDir,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would go; delete nothing")] = False,
) -> None:
    """Delete entries and shards the current index.json does not use, and stray files from interrupted writes."""
    from ..data.cache import prune_cache

    _check(folder)
    if dry_run:  # reads only
        r = prune_cache(folder, dry_run=True)
    else:
        from ..runtime.locks import writer_lock

        with writer_lock(folder, "cache"):  # not while a precompute writes into it
            r = prune_cache(folder, dry_run=False)
    verb = "would drop" if dry_run else "dropped"
    info(
        f"{verb} {r['entries_dropped']} entries, {r['shards_deleted']} shards and {r['stray_deleted']} stray files "
        f"({_gib(r['bytes_freed'])}); {r['unused_entries_kept_in_live_shards']} unused entries stay in shards still in use"
    )
