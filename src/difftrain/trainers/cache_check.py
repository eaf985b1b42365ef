"""Before training reads a single cached tensor: does the cache match this config?

A cache made from other weights, at another precision or with other caption settings would train
silently on wrong inputs (a VAE's latents are meaningless to a model that did not use that VAE; fp16
latents from SDXL's VAE can be NaN). Each difference is named, with the setting that caused it.
"""

from __future__ import annotations

from ..config.schema import Config
from ..data.cache import DataCache
from ..data.captions import CaptionAugment
from ..data.index import CacheIndex
from ..data.keys import cache_fingerprints
from ..data.masks import masks_wanted
from ..errors import CacheMismatch
from ..families.base import ModelFamily

_RERUN = "Run `difftrain precompute` with this config (it encodes only what differs), or point data.cache_dir at the cache made for it."


def cache_differences(
    cfg: Config, family: ModelFamily, cache: DataCache, index: CacheIndex, live_stages: list[str]
) -> list[str]:
    """What differs between the cache's index and what ``cfg`` would precompute, one line per difference;
    empty when they agree. Fields an older index lacks are not compared."""
    diffs = []
    pc = cfg.precompute
    for name, now in (("vae_dtype", pc.vae_dtype), ("text_encoder_dtype", pc.text_encoder_dtype)):
        then = getattr(index, name)
        if (
            then is not None
            and then != now
            and not (name == "text_encoder_dtype" and _all_live(family, cfg, live_stages))
        ):
            diffs.append(f"precompute.{name}: the cache was made with {then}, this config has {now}")
    cached_stages = index.text_stages
    if index.vae is not None or cached_stages is not None:
        memo = (
            cache.read_json("fingerprints.json", {}) or {}
        )  # weight hashes by file stat: no re-hashing when unchanged
        vae, stages = cache_fingerprints(family, cfg, memo)
        if index.vae not in (None, vae):
            diffs.append(
                f"the {family.image_encoder} weights: the cache holds latents of {index.vae[:12]}, "
                f"this model's are {vae[:12]} (model.path {cfg.model.path})"
            )
        for s, fp in stages.items():
            if s in live_stages or cached_stages is None:
                continue  # a trained encoder's captions are encoded on the fly: its cached embeddings are not read
            if s not in cached_stages:
                diffs.append(
                    f"text stage {s!r}: the cache has no embeddings for it (it was disabled when the cache was made)"
                )
            elif cached_stages[s] != fp and index.text_encoder_dtype in (None, pc.text_encoder_dtype):
                diffs.append(
                    f"text stage {s!r} ({', '.join(family.text_stages[s])}): other weights or options "
                    f"(text_encoders settings) than the cache was made with"
                )
    masks = masks_wanted(cfg.data)
    if masks is not None and index.masks != masks:
        diffs.append(
            f"masked loss: this config reads masks from {_masks_said(masks)}, the cache holds "
            + (f"masks from {_masks_said(index.masks)}" if index.masks else "none")
        )
    want = CaptionAugment.from_config(cfg.data)
    had_captions = index.captions
    if had_captions is not None and not _all_live(family, cfg, live_stages):
        record = want.record()
        changed = [
            f"{k} {had_captions.get(k)!r} -> {record[k]!r}"
            for k in record
            if k != "dropout" and had_captions.get(k) != record[k]
        ]
        if want.varies and had_captions.get("variants", 0) == 0:
            diffs.append(
                "data.shuffle_caption / caption_tag_dropout_rate: set, but the cache holds one version of each caption"
            )
        elif want.varies and changed:
            diffs.append("caption augmentation changed since the cache was made: " + ", ".join(changed))
        if want.dropout_rate > 0 and not (index.empty_text or _own_empty(index)):
            diffs.append("data.caption_dropout_rate > 0, but the cache holds no embedding of the empty caption")
        diffs += _subset_captions(cfg, index)
    diffs += _flips(cfg, index)
    return diffs


def _flips(cfg: Config, index: CacheIndex) -> list[str]:
    """flip_aug (the data section's or a subset's) set, but the cache holds no mirrored latents for those items."""
    d = cfg.data
    own = {d.subset_name(i): d.subset_data(i).flip_aug for i in range(len(d.subsets))}
    items = [it for it in index.items if own.get(it.subset, d.flip_aug)]
    if items and not any(it.flipped for it in items):
        where = "data.flip_aug" if d.flip_aug else "a subset's flip_aug"
        return [f"{where}: set, but the cache holds no mirrored latents of its items"]
    return []


def _own_empty(index: CacheIndex) -> bool:
    """Edit training's items each hold the empty instruction with their references (IndexItem.empty_texts)."""
    return bool(index.items) and all(it.empty_texts for it in index.items if not it.prior)


def _subset_captions(cfg: Config, index: CacheIndex) -> list[str]:
    """data.subsets' own caption augmentation against what the cache holds for their items (the index records the
    data section's; a subset's is seen in its items: augmented variants, the empty caption)."""
    d, out = cfg.data, []
    for i in range(len(d.subsets)):
        name, aug = d.subset_name(i), CaptionAugment.from_config(d.subset_data(i))
        items = [it for it in index.items if it.subset == name and not it.prior]
        if aug.varies and items and not any(it.text_variants for it in items):
            out.append(
                f"data.subsets {name!r}: shuffle_caption / caption_tag_dropout_rate set, but the cache holds one "
                "version of each of its captions"
            )
        if aug.dropout_rate > 0 and items and not (index.empty_text or _own_empty(index)):
            out.append(
                f"data.subsets {name!r}: caption_dropout_rate > 0, but the cache holds no embedding of the empty caption"
            )
    return out


def _masks_said(record: dict) -> str:
    if record.get("source") == "alpha":
        return "the alpha channel (data.alpha_mask)"
    return f"mask files (data.mask_dir {record.get('dir')}, data.mask_suffix {record.get('suffix', '')!r})"


def _all_live(family: ModelFamily, cfg: Config, live_stages: list[str]) -> bool:
    return set(family.enabled_stages(cfg.text_encoders)) <= set(live_stages)


def check_cache(cfg: Config, family: ModelFamily, cache: DataCache, index: CacheIndex, live_stages: list[str]) -> None:
    """:class:`CacheMismatch` naming every difference (see :func:`cache_differences`)."""
    diffs = cache_differences(cfg, family, cache, index, live_stages)
    if diffs:
        raise CacheMismatch(
            f"The cache at {cache.root} does not match this config:\n  - " + "\n  - ".join(diffs), hint=_RERUN
        )
