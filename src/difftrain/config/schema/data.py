"""``data``, ``precompute``, ``text_encoders`` and ``dreambooth``: the dataset and what is cached from it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from .base import Strict

#: DataConfig fields a subset may set for itself (None in the subset: the data section's value)
SUBSET_OVERRIDES: tuple[str, ...] = (
    "caption_ext",
    "tag_ext",
    "caption_prefix",
    "caption_suffix",
    "shuffle_caption",
    "keep_tokens",
    "keep_tokens_separator",
    "caption_separator",
    "caption_tag_dropout_rate",
    "caption_dropout_rate",
    "resolution",
    "bucket_step",
    "min_side",
    "max_side",
    "no_upscale",
    "frames",
    "alpha_mask",
    "flip_aug",
)


class SubsetConfig(Strict):
    """One folder of a dataset of several (sd-scripts' ``[[datasets.subsets]]``, diffusion-pipe's ``[[directory]]``):
    its own repeats, caption options and buckets; every other setting is the data section's. Items of every subset
    share one cache, keyed by content as always."""

    dir: Path = Field(description="its images (sd-scripts' image_dir); relative: to data.dir when set, else as given")
    metadata: Path | None = Field(default=None, description="merge-tags / sd-scripts metadata JSON (metadata_file)")
    name: str | None = Field(
        default=None,
        min_length=1,
        description="names it in the plan and the cache's index (default: its folder's name)",
    )
    num_repeats: int = Field(
        default=1, ge=1, le=100_000, description="times each image is seen per epoch (sd-scripts' num_repeats)"
    )
    is_reg: bool = Field(
        default=False,
        description="regularisation images (sd-scripts' is_reg): drawn beside each training batch and weighted by "
        "dreambooth.prior_loss_weight, as DreamBooth's class images",
    )
    class_tokens: str | None = Field(
        default=None, description="the caption of an image with no caption or tag file (sd-scripts' class_tokens)"
    )
    caption_ext: str | None = None
    tag_ext: str | None = None
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    shuffle_caption: bool | None = None
    keep_tokens: int | None = Field(default=None, ge=0)
    keep_tokens_separator: str | None = None
    caption_separator: str | None = Field(default=None, min_length=1)
    caption_tag_dropout_rate: float | None = Field(default=None, ge=0, lt=1)
    caption_dropout_rate: float | None = Field(default=None, ge=0, le=1)
    resolution: int | None = Field(default=None, ge=64, le=16384)
    bucket_step: int | None = Field(default=None, ge=8)
    min_side: int | None = Field(default=None, ge=8, le=16384)
    max_side: int | None = Field(default=None, ge=8, le=16384)
    no_upscale: bool | None = None
    frames: int | None = Field(default=None, ge=1, description="video families: this subset's longest frame bucket")
    alpha_mask: bool | None = Field(
        default=None,
        description="sd-scripts' alpha_mask: the image's alpha channel weights the loss (white/opaque = trained); "
        "read by the masked loss, which data.alpha_mask switches on for every subset",
    )
    flip_aug: bool | None = Field(default=None, description="sd-scripts' flip_aug for this subset (data.flip_aug)")

    def overrides(self) -> dict:
        """The data-section fields this subset sets for itself."""
        return {k: getattr(self, k) for k in SUBSET_OVERRIDES if getattr(self, k) is not None}


def _subset_name(subsets: list[SubsetConfig], i: int) -> str:
    s = subsets[i]
    if s.name:
        return s.name
    base = Path(s.dir).name or str(s.dir)
    earlier = [Path(t.dir).name or str(t.dir) for t in subsets[:i] if not t.name]
    return base if base not in earlier else f"{base}#{i}"


class DataConfig(Strict):
    dir: Path | None = Field(default=None, description="folder of images with caption/tag files")
    metadata: Path | None = Field(default=None, description="merge-tags JSON (optional)")
    allow_outside_paths: bool = Field(
        default=False,
        description="let dataset files lead outside data.dir: links to files "
        "elsewhere, videos.txt lines with absolute or ../ paths, metadata keys naming "
        "other folders (off: refused, so a dataset from elsewhere cannot read your files)",
    )
    caption_ext: str = ".caption"
    tag_ext: str = ".txt"
    caption_source: Literal["caption_then_tags", "caption_and_tags", "tags"] = "caption_then_tags"
    resolution: int = Field(default=1024, ge=64, le=16384, description="bucket max area = resolution^2")
    bucket_step: int = Field(default=64, ge=8)
    min_side: int = Field(default=512, ge=8, le=16384)
    max_side: int = Field(default=2048, ge=8, le=16384)
    no_upscale: bool = False
    max_upscale: float | None = Field(
        default=4.0,
        ge=1,
        description="skip (and report) an image that would have to be "
        "enlarged more than this to fill its bucket; null: any",
    )
    random_crop: bool = False
    flip_aug: bool = Field(
        default=False,
        description="sd-scripts' flip_aug: each image is also cached mirrored left-right, and each time it is drawn "
        "one of the two is taken (half the time each, seeded: a resumed run draws the same)",
    )
    cache_dir: Path | None = Field(default=None, description="precompute cache (default: <data.dir>/.difftrain-cache)")
    frames: int = Field(
        default=49, ge=1, description="video families: the longest frame bucket (4k+1; CogVideoX was trained with 49)"
    )
    frame_sampling: Literal["uniform", "first"] = Field(
        default="uniform", description="video families: frames spread evenly over the clip, or the first N"
    )
    fps: float | None = Field(
        default=None,
        gt=0,
        description="video families: resample each clip to this frame rate first (Wan: 16, Wan2.2 TI2V-5B: 24), "
        "then take consecutive frames from its start (frame_sampling is then not used); null: the clip's own frames",
    )
    caption_fallback: Literal["empty", "filename"] = Field(
        default="empty",
        description="an image with neither caption nor tags: the empty caption, or its file name "
        "(underscores as spaces); the tags as a caption's fallback are caption_source: caption_then_tags",
    )
    caption_prefix: str = Field(
        default="",
        description="put before every caption, a space between (sd-scripts' caption_prefix); shuffled with it, so "
        "end it with keep_tokens_separator (or count it in keep_tokens) to hold it in place",
    )
    caption_suffix: str = Field(
        default="", description="put after every caption, a space between (sd-scripts' caption_suffix)"
    )
    # caption augmentation (sd-scripts' names); works with cached text embeddings (see data/captions.py)
    shuffle_caption: bool = Field(default=False, description="shuffle the comma-separated tags of each caption")
    keep_tokens: int = Field(
        default=0, ge=0, description="the first N tags stay first and are never shuffled or dropped"
    )
    keep_tokens_separator: str = Field(
        default="",
        description="if set and present in a caption, what precedes it is kept instead of the first keep_tokens tags",
    )
    caption_separator: str = Field(default=",", min_length=1, description="what separates tags in a caption")
    caption_tag_dropout_rate: float = Field(
        default=0.0, ge=0, lt=1, description="chance of dropping each (not kept) tag"
    )
    caption_dropout_rate: float = Field(default=0.0, ge=0, le=1, description="chance of training on the empty caption")
    caption_variants: int = Field(
        default=8,
        ge=1,
        le=256,
        description="with shuffle or tag dropout and cached text "
        "embeddings: augmented versions of each caption precompute encodes",
    )
    # masked loss (data/masks.py): a weight per latent pixel, cached beside the latents
    alpha_mask: bool = Field(
        default=False,
        description="masked loss from the image's alpha channel (sd-scripts' alpha_mask): opaque is learned, "
        "transparent is not, half-transparent by half; an image without alpha is learned everywhere",
    )
    mask_dir: Path | None = Field(
        default=None,
        description="masked loss from mask images with the images' names (and sub-folders) in this folder "
        "(sd-scripts' conditioning_data_dir): white is learned, black is not, grey by its value (a colour mask: its "
        "red channel); resized to its image if drawn at another size of the same shape; an image without a mask is "
        "learned everywhere (precompute lists them); a video: one mask image, a folder of one per frame, or a mask "
        "video of as many frames",
    )
    mask_suffix: str = Field(
        default="",
        description="what a mask's file name adds to its image's name: OneTrainer's '-masklabel' "
        "(photo.jpg -> photo-masklabel.png); without data.mask_dir the masks lie beside the images",
    )

    subsets: list[SubsetConfig] = Field(
        default_factory=list,
        description="several folders in one run, each with its own repeats, captions and buckets (sd-scripts' "
        "dataset config: `--dataset-config FILE.toml`); data.dir is then not scanned itself",
    )
    dataset_config: Path | None = Field(
        default=None,
        description="sd-scripts' --dataset_config TOML or diffusion-pipe's dataset TOML, read into data.subsets "
        "(and train.batch_size) under your own settings; what does not map is listed (`--dataset-config FILE`)",
    )
    layout: Literal["auto", "kohya", "folder"] = Field(
        default="auto",
        description="auto: a data.dir whose image folders are all named <repeats>_<name> (sd-scripts' '10_sks dog') "
        "is read as kohya's layout (repeats, and the name as the caption of an image without one); folder: every "
        "image once, whatever its folders are called",
    )
    reg_dir: Path | None = Field(
        default=None,
        description="sd-scripts' reg_data_dir: regularisation images in the same <repeats>_<name> layout, drawn "
        "beside each training batch and weighted by dreambooth.prior_loss_weight",
    )
    control_dir: Path | list[Path] | None = Field(
        default=None,
        description="edit training (qwen-image-edit): the reference images, a folder beside data.dir with the "
        "targets' file names (several references: name_0.png, name_1.png ..., or a list of folders, one from each)",
    )
    pairs: Path | None = Field(
        default=None,
        description="edit training: a JSONL file of targets, references and instructions ({image, control or "
        "control_images or control_path_N, caption}; relative paths under data.dir), instead of scanning data.dir",
    )

    @field_validator("subsets")
    @classmethod
    def _subsets(cls, subsets: list[SubsetConfig], info: ValidationInfo) -> list[SubsetConfig]:
        # a field validator (not the model's), so that a problem is reported at data.subsets and attributed to the
        # layer that set them (a dataset config); the fields declared above are validated by now
        base = {k: v for k, v in info.data.items() if k in cls.model_fields}
        names: set[str] = set()
        for i, s in enumerate(subsets):
            unknown = sorted(k for k in s.overrides() if k not in cls.model_fields)
            if unknown:
                raise ValueError(
                    f"data.subsets[{i}] sets {', '.join(unknown)}, which this difftrain cannot apply yet: remove it"
                )
            name = _subset_name(subsets, i)
            if name in names:
                raise ValueError(
                    f"data.subsets[{i}]: another subset is named {name!r} too: give each a distinct data.subsets[].name"
                )
            names.add(name)
            try:
                DataConfig.model_validate({**base, **s.overrides()})
            except ValidationError as e:
                why = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
                raise ValueError(f"data.subsets[{i}] ({name}): {why}") from None
        return subsets

    def subset_name(self, i: int) -> str:
        """A subset's name: its own, or its folder's name (made distinct by its position when two share one)."""
        return _subset_name(self.subsets, i)

    def subset_data(self, i: int) -> DataConfig:
        """The data section as subset ``i`` sees it: its own values over the section's, validated."""
        merged = {**self.model_dump(exclude={"subsets"}), **self.subsets[i].overrides()}
        return DataConfig.model_validate(merged)

    @model_validator(mode="after")
    def _masks(self):
        if self.alpha_mask and (self.mask_dir is not None or self.mask_suffix):
            raise ValueError(
                "data.alpha_mask and data.mask_dir / mask_suffix both name where masks come from: keep one (the alpha "
                "channel, or the mask files)"
            )
        return self

    @model_validator(mode="after")
    def _sides(self):
        if not self.min_side <= self.resolution <= self.max_side:
            raise ValueError(
                f"resolution ({self.resolution}) must lie between min_side ({self.min_side}) and max_side ({self.max_side}): "
                "lower data.min_side or raise data.resolution"
            )
        if self.frames % 4 != 1:
            raise ValueError(
                f"data.frames ({self.frames}) must be 4k+1 (1, 5, ..., 49): the video VAE compresses time 4x "
                "after the first frame"
            )
        if self.resolution % self.bucket_step:
            raise ValueError(f"resolution ({self.resolution}) must be a multiple of bucket_step ({self.bucket_step})")
        return self


class PrecomputeConfig(Strict):
    vae_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32", description="SDXL's VAE gives NaN in fp16; fp32 or bf16 is safe"
    )
    text_encoder_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    batch_size: int = Field(default=4, ge=1)
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    shard_max_mb: float = Field(
        default=512, gt=0, description="cache shard size: entries are written in files of about this size"
    )
    num_workers: int | None = Field(
        default=None,
        ge=0,
        description="processes that decode and resize images while the "
        "encoder runs; null: half the CPU cores (at most 8); 0: in the main process",
    )


class T5Options(Strict):
    """SD3's T5-XXL: the largest encoder, used only at precompute time (its embeddings are cached)."""

    precision: Literal["int8", "nf4", "bf16", "fp16", "fp32"] = Field(
        default="int8",
        description="int8/nf4 through bitsandbytes (CUDA only): 5.5 / 4.0 GiB loaded instead of 8.9 GiB in bf16 (measured)",
    )
    max_length: int = Field(default=256, ge=77, le=512, description="T5 tokens per caption (SD3 was trained with 256)")
    enabled: bool = Field(
        default=True, description="false: T5 is never loaded and its embeddings are zeros (SD3 allows it)"
    )


class LLMOptions(Strict):
    """A language model used as the text encoder (Z-Image's Qwen3-4B), used only at precompute time: its hidden
    states are cached."""

    precision: Literal["int8", "nf4", "bf16", "fp16", "fp32"] = Field(
        default="int8",
        description="int8/nf4 through bitsandbytes (CUDA only), so the encoder fits beside the rest; a float type "
        "elsewhere",
    )


class TextEncodersConfig(Strict):
    t5: T5Options = Field(default_factory=T5Options)
    llm: LLMOptions = Field(default_factory=LLMOptions)


class DreamBoothConfig(Strict):
    """DreamBooth (the diffusers scripts' names): one instance prompt, optional prior preservation."""

    instance_prompt: str | None = Field(
        default=None, description='e.g. "a photo of sks dog": the caption of every training image'
    )
    use_captions: bool = Field(
        default=False, description="per-image captions where an image has one, the instance prompt for the rest"
    )
    with_prior_preservation: bool = False
    class_prompt: str | None = Field(default=None, description='e.g. "a photo of a dog"')
    class_data_dir: Path | None = Field(
        default=None, description="class images: supplied, or generated here up to num_class_images"
    )
    num_class_images: int = Field(default=100, ge=1)
    prior_loss_weight: float = Field(default=1.0, ge=0)
    class_sample_steps: int = Field(default=25, ge=1, description="denoising steps when generating class images")

    @model_validator(mode="after")
    def _prior(self):
        if self.with_prior_preservation and not (self.class_prompt and self.class_data_dir):
            raise ValueError(
                "dreambooth.with_prior_preservation needs dreambooth.class_prompt and dreambooth.class_data_dir "
                "(class images are generated there when it holds fewer than num_class_images)"
            )
        return self
