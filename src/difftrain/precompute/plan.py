"""The plan: what precompute caches, item by item, decided before anything is encoded.

Scanning the data folder (images, or clips for a video family), DreamBooth's instance prompt and class images,
the bucket of each item (dropping what fits none, with the reason), then the cache keys of its latent and its
captions (:mod:`difftrain.data.keys`). Every process of a distributed run makes the same plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config.schema import Config, DataConfig
from ..data.buckets import Bucket, choose_bucket, make_buckets
from ..data.cache import DataCache
from ..data.captions import CaptionAugment, caption_variants
from ..data.index import CacheIndex, IndexItem, TextKeys
from ..data.keys import CacheKeys, mask_key
from ..data.masks import MaskSource, MaskSpec, check_mask_size
from ..data.sources import ImageRecord, scan_dataset
from ..data.subsets import Subset, resolve_subsets
from ..errors import ConfigError, DataError, UsageError
from ..families.base import ModelFamily
from ..runtime.distributed import World
from ..runtime.distributed import barrier as dist_barrier
from ..utils import sha256_file
from .prior import ensure_class_images

if TYPE_CHECKING:
    from typing import TypeAlias

    from ..data.video import VideoRecord

Record: TypeAlias = "ImageRecord | VideoRecord"
Skipped: TypeAlias = "list[tuple[str, str]]"  # (path, why) of each file left out


@dataclass(frozen=True)
class Buckets:
    """The buckets items are sorted into: sizes, and a video family's frame counts (empty for images)."""

    sizes: list[Bucket]
    frames: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    """A record in its bucket: all a plan without keys (``precompute --plan``) needs."""

    record: Record
    bucket: Bucket  # (width, height)
    prior: bool = False  # a DreamBooth class image, or a regularisation image
    frames: int | None = None  # video: the frame bucket
    indices: list[int] | None = None  # video: the frames taken
    repeats: int = 1  # times it is seen per epoch (its subset's num_repeats)
    flip: bool = False  # flip_aug (its subset's): also cached mirrored left-right

    @property
    def size_name(self) -> str:
        return f"{self.bucket[0]}x{self.bucket[1]}"

    @property
    def shape_name(self) -> str:
        """The size and, for a clip, the frame count: ``96x64x9f``."""
        return self.size_name + (f"x{self.frames}f" if self.frames else "")


@dataclass(frozen=True, kw_only=True)
class PlanItem(Placement):
    """A placed record with the cache keys of its entries: what is encoded, and one item of index.json."""

    latent: str  # its latent entry's key
    image_sha256: str
    texts: TextKeys  # its caption's entry key per text stage
    variants: tuple[TextKeys, ...] = ()  # caption augmentation: each cached variant's keys
    mask: str | None = None  # masked loss: its mask entry's key (None: learned everywhere)
    mask_source: MaskSource | None = None  # where that mask is read
    empty_texts: TextKeys | None = None  # edit training's caption dropout: the empty instruction with its references
    flipped: str | None = None  # flip_aug: its mirrored latent entry's key
    flipped_mask: str | None = None  # flip_aug with masked loss: its mirrored mask entry's key

    def latent_jobs(self) -> list[tuple[str, bool]]:
        """(key, mirrored) of each latent entry it has: its own, and with flip_aug the mirrored one."""
        return [(self.latent, False)] + ([(self.flipped, True)] if self.flipped else [])

    @property
    def shape(self) -> tuple[Bucket, int]:
        """What a batch of latents never mixes: the bucket and the frame count (1 for an image)."""
        return (self.bucket, self.frames or 1)

    def index_item(self) -> IndexItem:
        r = self.record
        return IndexItem(
            key=r.key,
            latent=self.latent,
            texts=self.texts,
            bucket=self.bucket,
            caption=r.caption,
            image=str(r.path),
            original_size=(r.height, r.width),
            image_sha256=self.image_sha256,
            frames=self.frames,
            text_variants=self.variants,
            prior=self.prior,
            mask=self.mask,
            subset=r.subset,
            repeats=self.repeats,
            empty_texts=self.empty_texts,
            flipped=self.flipped,
            flipped_mask=self.flipped_mask,
        )


@dataclass
class Plan:
    """Every item to cache, the keys they were named by, and the caption each text entry encodes."""

    items: list[PlanItem]
    keys: CacheKeys
    captions: dict[str, str]  # text entry key -> the caption it encodes
    empty_text: TextKeys | None = None  # the empty caption's keys, for the caption dropout
    skipped: Skipped = field(default_factory=list)  # what the bucketing dropped
    masks: dict[str, Any] | None = None  # masked loss: MaskSpec.record() of the masks read
    #: edit training: text entry key -> the reference images its caption is encoded with
    references: dict[str, tuple[Path, ...]] = field(default_factory=dict)
    #: edit training of a family with ``text_references_fitted``: text entry key -> the bucket its references are
    #: fitted to and the random crop's seed (the target's sha256; None: centred), as precompute fits the latents'
    reference_fit: dict[str, tuple[Bucket, str | None]] = field(default_factory=dict)
    unmasked: list[tuple[str, str]] = field(default_factory=list)  # masked loss: (path, why) of items without a mask

    def text_sets(self) -> list[TextKeys]:
        """Every caption entry the items use ({stage: key} each): their captions, augmented variants, the empty
        caption."""
        sets = [t for p in self.items for t in (p.texts, *p.variants, *([p.empty_texts] if p.empty_texts else []))]
        return sets + ([self.empty_text] if self.empty_text else [])

    def index(self, cfg: Config, aug: CaptionAugment) -> CacheIndex:
        """index.json: the items and what their entries were made with."""
        return CacheIndex(
            family=self.keys.family,
            model=str(cfg.model.path),
            vae=self.keys.vae,
            text_stages=self.keys.stages,
            vae_dtype=cfg.precompute.vae_dtype,
            text_encoder_dtype=cfg.precompute.text_encoder_dtype,
            captions=aug.record(),
            empty_text=self.empty_text or None,
            masks=self.masks,
            items=[p.index_item() for p in self.items],
        )


# ------------------------------------------------------------------ scanning
def scan(
    cfg: Config, family: ModelFamily, world: World, device: torch.device, *, plan_only: bool = False
) -> tuple[list[tuple[Record, bool]], Skipped]:
    """The records to cache, each with whether it is a DreamBooth class image or a regularisation image, and the
    files the scans left out. Missing class images are generated first (by the first process; never for a plan)."""
    scanned, skipped = _scan_pairs(cfg) if family.references else _scan_data(cfg, family.video)
    db = cfg.dreambooth
    if family.video and db.with_prior_preservation:
        raise UsageError(
            "dreambooth.with_prior_preservation is not available for video families yet "
            "(class clips would have to be generated).",
            hint="Set dreambooth.with_prior_preservation: false.",
        )
    instance_prompt = db.instance_prompt
    if instance_prompt:
        scanned = [
            (r if reg else replace(r, caption=r.caption if (db.use_captions and r.caption) else instance_prompt), reg)
            for r, reg in scanned
        ]
    scanned, mask_files = _without_masks(scanned, cfg)
    skipped += mask_files
    out: list[tuple[Record, bool]] = scanned
    if db.with_prior_preservation and not plan_only:  # (a plan does not generate class images)
        class_records, class_skipped = _class_images(cfg, family, world, device)
        skipped += class_skipped
        out += [(r, True) for r in class_records]
    return out, skipped


def _scan_data(cfg: Config, video: bool) -> tuple[list[tuple[Record, bool]], Skipped]:
    """Every subset's records (data.dir read whole, kohya's folders, or data.subsets: :mod:`difftrain.data.subsets`),
    each with whether it is a regularisation image."""
    assert cfg.data.dir is not None or cfg.data.subsets  # precompute refuses a config without either first
    out: list[tuple[Record, bool]] = []
    skipped: Skipped = []
    for sub in resolve_subsets(cfg.data):
        records, left = _scan_subset(sub, video)
        out += [(r, sub.is_reg) for r in records]
        skipped += left
    return out, skipped


def _scan_pairs(cfg: Config) -> tuple[list[tuple[Record, bool]], Skipped]:
    """Edit training: the targets with their references (:mod:`difftrain.data.pairs`), from data.pairs or from
    data.dir with data.control_dir; a target without its references is skipped with the reason."""
    from ..data.pairs import same_counts, scan_pairs, with_control_dirs

    d = cfg.data
    if d.pairs is not None:
        assert d.dir is not None  # precompute refuses a config without one first
        records, left = scan_pairs(Path(d.pairs), Path(d.dir), d.allow_outside_paths)
    elif d.control_dir is not None:
        scanned, left_scan = _scan_data(cfg, video=False)
        dirs = d.control_dir if isinstance(d.control_dir, list) else [d.control_dir]
        controls = [Path(c).resolve() for c in dirs]
        # the control folder may lie inside data.dir: its images are references, not targets
        mine = [
            r
            for r, _ in scanned
            if isinstance(r, ImageRecord) and not any(Path(r.path).resolve().is_relative_to(c) for c in controls)
        ]
        records, left = with_control_dirs(mine, Path(d.dir or "."), dirs)
        left = [(Path(p), why) for p, why in left_scan] + left
    else:
        raise UsageError(
            "Edit training needs the reference image(s) of each target, and none were given.",
            hint="Set data.control_dir (a folder beside data.dir with the targets' file names; several references: "
            "name_0.png, name_1.png) or data.pairs (a JSONL file of image, control and caption).",
        )
    records, uneven = same_counts(records)
    return [(r, False) for r in records], [(str(p), why) for p, why in left + uneven]


def _scan_subset(sub: Subset, video: bool) -> tuple[list[Record], Skipped]:
    """One folder's records, keyed with its prefix and named by its subset; an image without caption or tags gets
    the subset's class tokens (kohya: the folder's name part). data.dir read whole gives its records as before."""
    d = sub.data
    records: list[Record]
    if video:
        from ..data.video import frame_buckets, scan_videos

        clips, left = scan_videos(
            sub.dir, caption_ext=d.caption_ext, buckets=frame_buckets(d.frames), allow_outside=d.allow_outside_paths
        )
        records = [
            replace(c, key=sub.key_prefix + c.key, subset=sub.name, caption=c.caption or sub.class_tokens or "")
            for c in clips
        ]
    else:
        images, left = scan_dataset(
            sub.dir,
            metadata=sub.metadata,
            caption_ext=d.caption_ext,
            tag_ext=d.tag_ext,
            caption_source=d.caption_source,
            caption_fallback="empty" if sub.class_tokens is not None else d.caption_fallback,
            allow_outside=d.allow_outside_paths,
        )
        records = [_in_subset(r, sub) for r in images]
    if d.caption_prefix or d.caption_suffix:  # sd-scripts' caption_prefix / caption_suffix, a space between
        records = [
            replace(r, caption=" ".join(filter(None, (d.caption_prefix, r.caption, d.caption_suffix)))) for r in records
        ]
    return records, [(str(p), why) for p, why in left]


def _in_subset(r: ImageRecord, sub: Subset) -> ImageRecord:
    if not sub.name:
        return r  # data.dir read whole: keys and captions as they always were
    if sub.class_tokens is not None and r.caption_from == "empty":
        r = replace(r, caption=sub.class_tokens, caption_from=sub.caption_label)
    return replace(r, key=sub.key_prefix + r.key, subset=sub.name)


def _class_images(
    cfg: Config, family: ModelFamily, world: World, device: torch.device
) -> tuple[list[ImageRecord], Skipped]:
    """The DreamBooth class images as records (key ``class:...``, caption the class prompt); the first process
    generates the missing ones, the others then find them."""
    class_prompt = cfg.dreambooth.class_prompt
    assert class_prompt is not None  # the config's validator requires it with prior preservation
    if not world.main:
        dist_barrier(world)
    folder = ensure_class_images(cfg, family, device)
    if world.main:
        dist_barrier(world)
    records, skipped = scan_dataset(folder)
    return [replace(r, key="class:" + r.key, caption=class_prompt) for r in records], [
        (str(p), why) for p, why in skipped
    ]


# ------------------------------------------------------------------ buckets
def buckets_for(d: DataConfig, video: bool) -> Buckets:
    if video:
        from ..data.video import frame_buckets, video_size_buckets

        return Buckets(video_size_buckets(d.resolution, d.bucket_step, d.min_side, d.max_side), frame_buckets(d.frames))
    return Buckets(make_buckets(d.resolution, d.bucket_step, d.min_side, d.max_side))


def place(record: Record, prior: bool, d: DataConfig, buckets: Buckets) -> Placement | str:
    """``record`` in its bucket, or why it fits none."""
    frames, indices = None, None
    try:
        if isinstance(record, ImageRecord):
            bucket = choose_bucket(
                record.width,
                record.height,
                buckets.sizes,
                resolution=d.resolution,
                step=d.bucket_step,
                no_upscale=d.no_upscale,
            )
        else:
            from ..data.video import (
                choose_frames,
                choose_video_bucket,
                frame_rate_varies,
                frames_at_rate,
                resampled_indices,
                sample_frame_indices,
            )

            bucket = choose_video_bucket(record.width, record.height, buckets.sizes)
            rate = d.fps if d.fps and not record.is_image else None
            if rate is not None and record.fps <= 0:
                raise ValueError("its frame rate is unknown (the file states none), so data.fps cannot resample it")
            if rate is not None and frame_rate_varies(record.path):
                raise ValueError(
                    "its frame rate varies (its frames are not evenly spaced in time), so data.fps cannot resample "
                    f"it: re-encode it at a constant rate (ffmpeg -i IN -vf fps={rate:g} OUT)"
                )
            n = record.frames if rate is None else frames_at_rate(record.frames, record.fps, rate)
            frames = choose_frames(n, buckets.frames, is_image=record.is_image)
            if frames is None:
                at = "" if rate is None else f" ({n} at data.fps {rate:g}, from {record.frames} at {record.fps:g} fps)"
                raise ValueError(
                    f"{record.frames} frames{at}: shorter than the smallest frame bucket ({buckets.frames[1]})"
                )
            if rate is None:
                indices = sample_frame_indices(record.frames, frames, mode=d.frame_sampling)
            else:
                indices = resampled_indices(record.frames, record.fps, rate, frames)
    except ValueError as e:  # e.g. smaller than one bucket step with no_upscale
        return str(e)
    enlarge = max(bucket[0] / record.width, bucket[1] / record.height)
    if d.max_upscale is not None and enlarge > d.max_upscale:
        return (
            f"too small: {record.width}x{record.height} would be enlarged {enlarge:.1f}x to fill "
            f"its bucket {bucket[0]}x{bucket[1]} (data.max_upscale is {d.max_upscale:g})"
        )
    return Placement(record, bucket, prior, frames, indices, flip=d.flip_aug)


def place_all(
    records: list[tuple[Record, bool]], d: DataConfig, buckets: Buckets, subsets: list[Subset] | None = None
) -> tuple[list[Placement], Skipped]:
    """Every record that fits a bucket, placed; and those that do not, with the reason, in the records' order. A
    record of one of ``subsets`` is placed by that subset's settings (its resolution, buckets and repeats)."""
    own: dict[str, tuple[Subset | None, Buckets]] = {}
    for sub in subsets or []:
        own[sub.name] = (sub, buckets if sub.data == d else buckets_for(sub.data, bool(buckets.frames)))
    placed: list[Placement] = []
    skipped: Skipped = []
    for r, prior in records:
        found, sub_buckets = own.get(r.subset, (None, buckets))
        p = place(r, prior, found.data if found is not None else d, sub_buckets)
        if isinstance(p, str):
            skipped.append((str(r.path), p))
        else:
            placed.append(p if found is None or found.repeats == 1 else replace(p, repeats=found.repeats))
    return placed, skipped


# ------------------------------------------------------------------ keys
def cache_keys(cfg: Config, family: ModelFamily, cache: DataCache, world: World) -> CacheKeys:
    """The keys of this config's entries: they need the encoders' weight hashes, memoised in the cache's
    fingerprints.json (which the first process writes back). Each text stage has its own key: a changed T5
    precision re-encodes T5 only."""
    memo = cache.read_json("fingerprints.json", {})
    keys = CacheKeys.for_config(family, cfg, memo, video=family.video)
    if world.main:
        cache.write_json("fingerprints.json", memo)
    return keys


def hash_images(records: list[tuple[Record, bool]]) -> dict[Path, str]:
    """The files' sha256 (their latents' keys), read by threads: hashing releases the GIL, and one thread at a
    time would leave a fast disk idle."""
    paths = [r.path for r, _ in records]
    paths += list(dict.fromkeys(x for r, _ in records for x in getattr(r, "references", ())))  # edit training
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(paths, pool.map(sha256_file, paths)))


def make_plan(
    records: list[tuple[Record, bool]], cfg: Config, family: ModelFamily, cache: DataCache, world: World
) -> Plan:
    """The full plan: buckets, fingerprints, the files' hashes, and every entry's key."""
    buckets = buckets_for(cfg.data, family.video)
    keys = cache_keys(cfg, family, cache, world)
    aug = CaptionAugment.from_config(cfg.data)
    subsets = resolve_subsets(cfg.data)
    augs = {sub.name: CaptionAugment.from_config(sub.data) for sub in subsets}  # each subset's own augmentation
    hashes = hash_images(records)
    placed, skipped = place_all(records, cfg.data, buckets, subsets)
    if family.references and any(p.flip for p in placed):
        # the instruction is encoded with the reference images (encode_prompts_with_images): a mirrored target would
        # need mirrored references and its own instruction embedding; refused rather than trained inconsistently
        raise ConfigError(
            f"data.flip_aug is not available for {family.name}: its instructions are encoded with the reference "
            "images, which a mirrored target would not match.",
            hint="Set data.flip_aug: false (and in data.subsets), or flip the pairs on disk.",
        )
    plan = Plan(items=[], keys=keys, captions={}, skipped=skipped)
    dropout = any(a.dropout_rate > 0 for a in (aug, *augs.values()))
    if dropout and not family.references:  # the empty caption, once, for the caption dropout
        plan.empty_text = keys.texts("")
        plan.captions.update((k, "") for k in plan.empty_text.values())
    for p in placed:
        refs = tuple(getattr(p.record, "references", ()))  # edit training: keyed by the references' content too
        ref_shas = [hashes[r] for r in refs]
        text_refs, fit = ref_shas, None
        if refs and family.text_references_fitted:
            # the caption is encoded with the references fitted to this target's bucket and cropped as its latents'
            # (the same Random(sha) seed as the decoder's): keyed by the bucket and, with a random crop, the target
            seed = hashes[p.record.path] if cfg.data.random_crop else None
            fit = (p.bucket, seed)
            text_refs = [*ref_shas, f"fitted:{p.size_name}:{seed or 'centred'}"]
        item = _keyed(
            p, keys, hashes[p.record.path], augs.get(p.record.subset, aug), plan.captions, ref_shas, text_refs
        )
        if refs and dropout:  # edit training: the empty instruction with this item's references, its own entry
            empty = keys.texts("", text_refs)
            item = replace(item, empty_texts=empty)
            plan.captions.update((k, "") for k in empty.values())
        plan.items.append(item)
        if refs:
            own = (item.texts, *item.variants, item.empty_texts or {})
            plan.references.update((k, refs) for t in own for k in t.values())
            if fit is not None:
                plan.reference_fit.update((k, fit) for t in own for k in t.values())
    add_masks(plan, cfg)
    return plan


def _keyed(
    p: Placement,
    keys: CacheKeys,
    sha: str,
    aug: CaptionAugment,
    captions: dict[str, str],
    refs: Sequence[str] = (),
    text_refs: Sequence[str] | None = None,
) -> PlanItem:
    """``p`` with its entries' keys; the captions they encode are added to ``captions``. ``refs``: the sha256 of
    its reference images (edit training); ``text_refs``: what keys its captions' entries besides the caption, if not
    ``refs`` (the references' fit too)."""
    caption = p.record.caption
    text_refs = refs if text_refs is None else text_refs
    texts = keys.texts(caption, text_refs)
    captions.update((k, caption) for k in texts.values())
    variants: list[TextKeys] = []
    if aug.varies and not p.prior:  # augmented captions, each cached like any caption
        for v in caption_variants(caption, aug):
            variants.append(keys.texts(v, text_refs))
            captions.update((k, v) for k in variants[-1].values())
    return PlanItem(
        record=p.record,
        bucket=p.bucket,
        prior=p.prior,
        frames=p.frames,
        indices=p.indices,
        repeats=p.repeats,
        latent=keys.latent(p.bucket, sha, p.frames, refs),
        flipped=keys.latent(p.bucket, sha, p.frames, refs, flip=True) if p.flip else None,
        image_sha256=sha,
        texts=texts,
        variants=tuple(variants),
    )


# ------------------------------------------------------------------ masks
#: OneTrainer's mask files (``photo-masklabel.png`` beside ``photo.jpg``): never training images
ONETRAINER_MASK = "-masklabel"


def _without_masks(scanned: list[tuple[Record, bool]], cfg: Config) -> tuple[list[tuple[Record, bool]], Skipped]:
    """The records that are not masks: files in data.mask_dir (when it lies inside the data folder) and names
    with data.mask_suffix (or OneTrainer's ``-masklabel``) are masks, left out of the training images (said)."""
    spec = MaskSpec.from_config(cfg.data)
    folder = spec.folder.resolve() if spec.folder is not None else None
    kept: list[tuple[Record, bool]] = []
    left: Skipped = []
    for r, reg in scanned:
        if folder is not None and Path(r.path).resolve().is_relative_to(folder):
            left.append((str(r.path), "a mask (in data.mask_dir), not a training image"))
        elif spec.is_mask_file(r.path):
            left.append((str(r.path), f"a mask (its name ends in data.mask_suffix {spec.suffix!r})"))
        elif Path(r.path).stem.endswith(ONETRAINER_MASK) and not spec.suffix:
            left.append((str(r.path), f"a OneTrainer mask; to train with it, set data.mask_suffix: {ONETRAINER_MASK}"))
        else:
            kept.append((r, reg))
    return kept, left


def mask_spec(cfg: Config, record: Record) -> tuple[MaskSpec, Path | None]:
    """The masks ``record`` is trained with (its subset's data settings: a subset may set its own) and the folder
    its key in the mask folder is relative to: the data folder for data.mask_dir, the subset's for its own."""
    data, root = cfg.data, cfg.data.dir
    subset = getattr(record, "subset", "")
    if subset:
        from ..data.subsets import resolve_subsets

        for sub in resolve_subsets(cfg.data):
            if sub.name == subset:
                data = sub.data
                own_dir = data.mask_dir is not None and data.mask_dir != cfg.data.mask_dir
                inside = root is not None and Path(record.path).resolve().is_relative_to(Path(root).resolve())
                root = sub.dir if own_dir or not inside else root
    return MaskSpec.from_config(data), Path(root) if root is not None else None


#: how the plan names each source of masks
_MASK_KINDS = {"alpha": "alpha channel", "file": "mask file", "frames": "mask per frame", "video": "mask video"}


@dataclass
class MaskPlan:
    """Where each placed item's mask is read (None: learned everywhere), the items without one and why, and what
    the index records of them; ``sources`` is empty when no item is trained with masks."""

    sources: list[MaskSource | None] = field(default_factory=list)
    unmasked: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    record: dict[str, Any] | None = None

    def counts(self) -> dict[str, int]:
        """Items per mask source (alpha channel, mask file, per-frame masks) and without a mask."""
        out: dict[str, int] = {}
        for s in self.sources:
            name = _MASK_KINDS[s.kind] if s else "none"
            out[name] = out.get(name, 0) + 1
        return out


def find_masks(placed: Sequence[Placement], cfg: Config) -> MaskPlan:
    """Each item's mask (masked loss), its size checked against its image's: DataError naming both when the shapes
    differ, when a per-frame mask folder has another frame count than its clip, and when mask files are asked for
    and no item has one (a wrong data.mask_dir or data.mask_suffix). Items without a mask are listed."""
    from ..data.masks import alpha_present

    out = MaskPlan()
    specs: dict[str, tuple[MaskSpec, Path | None]] = {}
    file_spec: MaskSpec | None = None
    stems = Counter(Path(p.record.path).stem for p in placed)
    for p in placed:
        r = p.record
        sub = getattr(r, "subset", "")
        if sub not in specs:
            specs[sub] = mask_spec(cfg, r)
        spec, root = specs[sub]
        if not spec.enabled or (p.prior and not sub):  # DreamBooth's generated class images have no masks
            out.sources.append(None)
            continue
        out.record = out.record or spec.record()
        file_spec = spec if spec.files else file_spec
        rel, guard = _relative_key(r, root), None if cfg.data.allow_outside_paths else root
        source = spec.find(rel, r.path, video=p.frames is not None, root=guard)
        if source is None and "/" in rel and spec.folder is not None and stems[Path(r.path).stem] == 1:
            # a flat mask folder for images in sub-folders (kohya's 10_name folders): by the name alone, when no
            # other image has that name
            source = spec.find(Path(rel).name, r.path, video=p.frames is not None, root=guard)
        if source is not None and source.kind == "alpha" and not alpha_present(r.path):
            out.unmasked.append((str(r.path), "no alpha channel: learned everywhere"))
            source = None
        elif source is None:
            out.unmasked.append((str(r.path), "no mask file: learned everywhere"))
        else:
            check_mask_size(source, r.path, (r.width, r.height), getattr(r, "frames", 1))
        out.sources.append(source)
    if out.record is None:
        return MaskPlan()
    if file_spec is not None and not any(s is not None and s.kind != "alpha" for s in out.sources):
        where = f"in {file_spec.folder}" if file_spec.folder is not None else "beside the images"
        raise DataError(
            f"masked loss: no image has a mask file {where}"
            + (f" (names ending in {file_spec.suffix!r})" if file_spec.suffix else ""),
            hint="a mask has its image's name and sub-folder (data.mask_suffix before the extension); check "
            "data.mask_dir and data.mask_suffix",
        )
    return out


def add_masks(plan: Plan, cfg: Config) -> None:
    """The items' masks (:func:`find_masks`) hashed and keyed: a mask's entry is named by its latent's key, its
    source and its content, so a changed mask is encoded again without its latent."""
    from ..utils import sha256_file, sha256_text

    found = find_masks(plan.items, cfg)
    plan.masks = found.record
    plan.unmasked = found.unmasked
    for i, (p, source) in enumerate(zip(plan.items, found.sources)):
        if source is not None:
            sha = "" if source.kind == "alpha" else sha256_text(*(sha256_file(f) for f in source.files()))
            flipped = mask_key(p.flipped, source.kind, sha) if p.flipped else None  # flip_aug: the mirrored mask
            plan.items[i] = replace(
                p, mask=mask_key(p.latent, source.kind, sha), mask_source=source, flipped_mask=flipped
            )


def _relative_key(record: Record, root: Path | None) -> str:
    """The item's path under ``root`` without extension ('/'-separated): its mask's name in the mask folder."""
    path = Path(record.path)
    if root is not None:
        try:
            return path.resolve().relative_to(Path(root).resolve()).with_suffix("").as_posix()
        except ValueError:
            pass
    return path.stem
