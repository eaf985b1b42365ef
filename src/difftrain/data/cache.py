"""The precompute cache: content-addressed entries in sharded safetensors files.

Layout of a cache folder::

    manifest.json            {"version", "entries": {key: {shard, names}}, "shards": {shard: bytes}}
    index.json               the items of the last precompute (what training reads)
    fingerprints.json        memo of encoder weight hashes, by file path/size/mtime
    shards/ab/<id>.safetensors

An entry is a small set of named tensors (a latent, or one caption's text
embeddings) stored under ``<key>/<name>`` in a shard. Its key is a hash of
everything that determines it (family, encoder weights, dtype, bucket, image
bytes or caption), so a changed caption or precision recomputes only what
changed and two configs over the same data share entries.

Writes are crash-safe: a shard is written to a temporary file and renamed,
and the manifest (written the same way) only names complete shards. A run
killed mid-way leaves a valid cache holding every shard finished before it.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config.schema import Config
from ..errors import CacheMismatch, UsageError
from ..utils import atomic_write_json, read_safetensors_header

CACHE_VERSION = 1
#: the only shard names a manifest may hold (what :meth:`DataCache.flush` writes): nothing read from a cache
#: folder can point at a file outside it
SHARD_NAME = re.compile(r"shards/[0-9a-f]{2}/[0-9a-f]{32}\.safetensors")
_REBUILD = "Delete the cache folder and run `difftrain precompute` again."


def _damaged(path: Path, what: str) -> CacheMismatch:
    return CacheMismatch(f"{path} is damaged or was not written by difftrain: {what}.", hint=_REBUILD)


def check_manifest(m, path: Path) -> dict:
    """``m`` if it is a manifest whose every shard name is one :meth:`DataCache.flush` writes; else CacheMismatch."""
    if (
        not isinstance(m, dict)
        or not isinstance(m.get("entries", {}), dict)
        or not isinstance(m.get("shards", {}), dict)
    ):
        raise _damaged(path, "not a manifest (an object with 'entries' and 'shards')")
    for rel, size in m.get("shards", {}).items():
        if not SHARD_NAME.fullmatch(rel) or not isinstance(size, int) or isinstance(size, bool):
            raise _damaged(path, f"the shard {rel!r}: {size!r} is not a shards/xx/<id>.safetensors name with its size")
    for key, e in m.get("entries", {}).items():
        if not (
            isinstance(e, dict)
            and isinstance(e.get("shard"), str)
            and SHARD_NAME.fullmatch(e["shard"])
            and isinstance(e.get("names"), list)
            and all(isinstance(n, str) for n in e["names"])
        ):
            raise _damaged(path, f"the entry {key[:40]!r} is not {{shard: shards/xx/<id>.safetensors, names: [...]}}")
    return m


def _ints(v, n: int) -> bool:
    return (
        isinstance(v, list)
        and len(v) == n
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 < x < 2**20 for x in v)
    )


def _text_keys(t) -> bool:
    return isinstance(t, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in t.items())


def check_index(index, path: Path) -> dict:
    """``index`` if it has the shape precompute writes (the fields training reads, with their types); else
    CacheMismatch naming the first bad item. Its entries are keys of the manifest, never file names."""
    if not isinstance(index, dict) or not isinstance(index.get("items", []), list):
        raise _damaged(path, "not an object with a list of 'items'")
    if not (index.get("empty_text") is None or _text_keys(index["empty_text"])):
        raise _damaged(path, "'empty_text' is not an object of stage -> entry key")
    for i, it in enumerate(index.get("items", [])):
        ok = (
            isinstance(it, dict)
            and isinstance(it.get("key"), str)
            and isinstance(it.get("caption", ""), str)
            and isinstance(it.get("latent"), str)
            and _ints(it.get("bucket"), 2)
            and _ints(it.get("original_size", [1, 1]), 2)
            and _ints([it.get("frames", 1)], 1)
            and _text_keys(it.get("texts"))
            and isinstance(it.get("text_variants", []), list)
            and all(_text_keys(t) for t in it.get("text_variants", []))
        )
        if not ok:
            raise _damaged(
                path, f"item {i} lacks a field or has one of the wrong type (key, latent, bucket, texts ...)"
            )
    return index


def cache_dir_for(cfg: Config) -> Path:
    """data.cache_dir, or <data.dir>/.difftrain-cache (without data.dir: beside the first of data.subsets, as
    sd-scripts keeps its caches in the image folders)."""
    if cfg.data.cache_dir is not None:
        return Path(cfg.data.cache_dir)
    if cfg.data.dir is None and cfg.data.subsets:
        return Path(cfg.data.subsets[0].dir) / ".difftrain-cache"
    if cfg.data.dir is None:
        raise UsageError("No data folder was given.", hint="Set data.dir (--set data.dir=/path/to/images).")
    return Path(cfg.data.dir) / ".difftrain-cache"


class DataCache:
    def __init__(self, root: Path, shard_max_bytes: int = 512 << 20, writer: int = 0):
        """``writer``: 0 for the one process that owns manifest.json; process ``r`` of a precompute on several
        processes records its new shards in ``manifest.rank<r>.json`` (see :func:`merge_manifests`)."""
        self.root = Path(root)
        self.shard_max_bytes = shard_max_bytes
        self.manifest_name = "manifest.json" if writer == 0 else f"manifest.rank{writer}.json"
        self.manifest = check_manifest(
            self._read("manifest.json", {"version": CACHE_VERSION, "entries": {}, "shards": {}}),
            self.root / "manifest.json",
        )
        self._own: dict[str, Any] = {"version": CACHE_VERSION, "entries": {}, "shards": {}}  # what this writer added
        if self.manifest.get("version") != CACHE_VERSION:
            raise CacheMismatch(
                f"The cache at {self.root} has format version {self.manifest.get('version')}, this difftrain writes {CACHE_VERSION}.",
                hint="Point data.cache_dir at a new folder, or delete the old cache.",
            )
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_keys: dict[str, list[str]] = {}
        self._pending_bytes = 0
        self._handles: OrderedDict[str, object] = OrderedDict()

    # -------------------------------------------------------------- files
    def _read(self, name: str, default):
        p = self.root / name
        if not p.exists():
            return default
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise CacheMismatch(f"{p} is damaged (not valid JSON).", hint=_REBUILD) from None

    def read_json(self, name: str, default=None):
        return self._read(name, default)

    def write_json(self, name: str, obj) -> None:
        atomic_write_json(self.root / name, obj)

    # -------------------------------------------------------------- entries
    def has(self, key: str) -> bool:
        return key in self.manifest["entries"]

    def missing(self, keys: Iterable[str]) -> list[str]:
        seen, out = set(), []
        for k in keys:
            if k not in seen and not self.has(k) and k not in self._pending_keys:
                seen.add(k)
                out.append(k)
        return out

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Queue an entry; shards are written once they reach the size limit (and on flush)."""
        for name, t in tensors.items():
            t = t.detach().to("cpu").contiguous()
            self._pending[f"{key}/{name}"] = t
            self._pending_bytes += t.numel() * t.element_size()
        self._pending_keys[key] = sorted(tensors)
        if self._pending_bytes >= self.shard_max_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        sid = uuid.uuid4().hex
        rel = f"shards/{sid[:2]}/{sid}.safetensors"
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(self._pending, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        for k, names in self._pending_keys.items():
            self.manifest["entries"][k] = self._own["entries"][k] = {"shard": rel, "names": names}
        self.manifest["shards"][rel] = self._own["shards"][rel] = path.stat().st_size
        # the main writer rewrites the whole manifest; another process writes only what it added
        self.write_json(self.manifest_name, self.manifest if self.manifest_name == "manifest.json" else self._own)
        self._pending, self._pending_keys, self._pending_bytes = {}, {}, 0

    def reload(self) -> None:
        """Read manifest.json again (another process merged into it)."""
        self.manifest = check_manifest(self._read("manifest.json", self.manifest), self.root / "manifest.json")

    def get(self, key: str) -> dict[str, torch.Tensor]:
        try:
            entry = self.manifest["entries"][key]
        except KeyError:
            raise CacheMismatch(
                f"The cache at {self.root} has no entry {key[:12]}...",
                hint="Run `difftrain precompute` with the same config first.",
            ) from None
        handle = self._handle(entry["shard"])
        try:
            return {name: handle.get_tensor(f"{key}/{name}") for name in entry["names"]}
        except Exception as e:  # noqa: BLE001 - safetensors' own error types: a tensor missing or cut short
            raise CacheMismatch(
                f"The cache shard {self.root / entry['shard']} cannot be read: {e}.", hint=_REBUILD
            ) from None

    def _handle(self, rel: str):
        if rel in self._handles:
            self._handles.move_to_end(rel)
            return self._handles[rel]
        path = self.root / rel
        if not path.exists():
            raise CacheMismatch(
                f"The cache shard {path} is missing.", hint="Run `difftrain precompute` again to rebuild it."
            )
        try:
            read_safetensors_header(path)  # an absurd header length is refused before anything is allocated
            h = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - ValueError from the check, safetensors' own errors
            raise CacheMismatch(
                f"The cache shard {path} cannot be read: {str(e).replace(str(path), 'it')}.", hint=_REBUILD
            ) from None
        self._handles[rel] = h
        if len(self._handles) > 8:  # a few open shards at a time: memory stays flat
            self._handles.popitem(last=False)
        return h


def merge_manifests(root: Path) -> int:
    """Fold every ``manifest.rank<r>.json`` of a several-process precompute into manifest.json (atomically),
    then delete them; returns how many entries were added. Their shards are complete files already."""
    root = Path(root)
    cache = DataCache(root)
    added = 0
    parts = sorted(root.glob("manifest.rank*.json"))
    for part in parts:
        own = check_manifest(cache.read_json(part.name), part)
        added += sum(k not in cache.manifest["entries"] for k in own["entries"])
        cache.manifest["entries"].update(own["entries"])
        cache.manifest["shards"].update(own["shards"])
    if parts:
        cache.write_json("manifest.json", cache.manifest)
        for part in parts:
            part.unlink()
    return added


# ------------------------------------------------------------------ maintenance: difftrain cache info | verify | prune
def _referenced(cache: DataCache) -> set[str]:
    """Entry keys that index.json uses: each item's latent and captions of every stage, their augmented
    variants, and the empty caption of the caption dropout."""
    index = check_index(cache.read_json("index.json", {}) or {}, cache.root / "index.json")
    keys = set((index.get("empty_text") or {}).values())
    for it in index.get("items", []):
        keys.add(it.get("latent"))
        for texts in (it.get("texts") or {}, *(it.get("text_variants") or ()), it.get("empty_texts") or {}):
            keys.update(texts.values())
    keys.discard(None)
    return keys


def cache_info(root: Path) -> dict:
    """Counts and sizes: entries, shards (and their bytes), index items, entries the index does not use."""
    cache = DataCache(root)
    index = check_index(cache.read_json("index.json", {}) or {}, cache.root / "index.json")
    used = _referenced(cache)
    shards = cache.manifest["shards"]
    return {
        "root": str(cache.root),
        "entries": len(cache.manifest["entries"]),
        "shards": len(shards),
        "bytes": sum(shards.values()),
        "items": len(index.get("items", [])),
        "family": index.get("family"),
        "unused_entries": sum(k not in used for k in cache.manifest["entries"]),
        "stray_files": [str(p.relative_to(cache.root)) for p in _stray(cache)],
    }


def _stray(cache: DataCache) -> list[Path]:
    """Files under shards/ that the manifest does not name (a write killed before its rename, a pruned shard)."""
    known = set(cache.manifest["shards"])
    folder = cache.root / "shards"
    return (
        sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(cache.root).as_posix() not in known)
        if folder.is_dir()
        else []
    )


def verify_cache(root: Path) -> list[str]:
    """Every problem found: a shard missing, of another size than recorded, or unreadable; an entry whose tensors
    are not in its shard; an index item whose entry is missing. Empty when the cache is sound."""
    cache = DataCache(root)
    problems = []
    by_shard: dict[str, list[str]] = {}
    for key, entry in cache.manifest["entries"].items():
        by_shard.setdefault(entry["shard"], []).append(key)
    for rel, size in cache.manifest["shards"].items():
        path = cache.root / rel
        if not path.is_file():
            problems.append(f"shard {rel} is missing")
            continue
        if path.stat().st_size != size:
            problems.append(f"shard {rel} has {path.stat().st_size} bytes, the manifest recorded {size}")
            continue
        try:
            read_safetensors_header(path)
            with safe_open(str(path), framework="pt", device="cpu") as h:
                names = set(h.keys())
        except Exception as e:  # noqa: BLE001 - any failure to parse is a damaged shard
            problems.append(f"shard {rel} cannot be read: {e}")
            continue
        for key in by_shard.get(rel, []):
            lost = [n for n in cache.manifest["entries"][key]["names"] if f"{key}/{n}" not in names]
            if lost:
                problems.append(f"entry {key[:12]}... lacks {', '.join(lost)} in {rel}")
    for key in by_shard:
        if key not in cache.manifest["shards"]:
            problems.append(f"{len(by_shard[key])} entries point at {key}, which the manifest does not list")
    missing = [k for k in _referenced(cache) if k not in cache.manifest["entries"]]
    if missing:
        problems.append(f"index.json uses {len(missing)} entries the cache does not have (e.g. {missing[0][:12]}...)")
    return problems


def prune_cache(root: Path, dry_run: bool = False) -> dict:
    """Drop what index.json does not use: entries, shards left with no used entry, stray files. A shard that
    still holds a used entry is kept whole (its unused bytes are reported). The manifest is rewritten first,
    so an interrupted prune leaves only stray files, which the next prune removes."""
    cache = DataCache(root)
    used = _referenced(cache)
    if not cache.read_json("index.json"):
        raise CacheMismatch(
            f"The cache at {cache.root} has no index.json: nothing says which entries are in use.",
            hint="Run `difftrain precompute` first (prune keeps what its index uses).",
        )
    entries = cache.manifest["entries"]
    drop = [k for k in entries if k not in used]
    live_shards = {entries[k]["shard"] for k in entries if k in used}
    dead_shards = [rel for rel in cache.manifest["shards"] if rel not in live_shards]
    kept_unused = sum(1 for k in drop if entries[k]["shard"] in live_shards)
    freed = sum(cache.manifest["shards"][rel] for rel in dead_shards)
    stray = _stray(cache)
    freed += sum(p.stat().st_size for p in stray)
    if not dry_run:
        for k in drop:
            del entries[k]
        for rel in dead_shards:
            del cache.manifest["shards"][rel]
        cache.write_json("manifest.json", cache.manifest)
        for rel in dead_shards:
            (cache.root / rel).unlink(missing_ok=True)
        for p in stray:
            p.unlink(missing_ok=True)
    return {
        "entries_dropped": len(drop),
        "shards_deleted": len(dead_shards),
        "stray_deleted": len(stray),
        "bytes_freed": freed,
        "unused_entries_kept_in_live_shards": kept_unused,
    }
