"""The model families: the one list. Adding a family is its package ``families/<name>/`` (a
:class:`~difftrain.families.base.ModelFamily` subclass, exported by the package), its bundled configs under
families/configs/, and one row here.

A row holds the facts that are read before any weight or torch is imported (the config's validation, the command
line): the family's name, where its class is, its default bundled architecture, and which sd-scripts scripts map
to it. Everything else a family knows is on its class. tests/unit/test_families.py checks each row against its class.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config.schema import FamilyFacts
from ..errors import UsageError

if TYPE_CHECKING:
    from .base import ModelFamily


@dataclass(frozen=True)
class Registered:
    name: str  # the config's ``family`` value (and the class's ``name``)
    module: str  # its package, difftrain.families.<module>, which exports the class
    cls: str  # its ModelFamily subclass
    #: the bundled architecture (families/configs/<name>) when model.config is not set
    default_architecture: str
    #: speed.channels_last has convolutions to act on (a UNet denoiser)
    channels_last: bool = False
    #: sd-scripts' scripts of this family start with this (``sdxl_train_network.py``, ``flux_train.py``; musubi-tuner's
    #: ``wan_train_network.py``): `difftrain convert-args` maps their options to this family
    sd_scripts_prefix: str | None = None
    #: the model.* options naming a part's own file that this family's loading reads (model.ae, model.clip_l, ...):
    #: what `difftrain convert-args` maps sd-scripts' --vae / --ae / --clip_l / --t5xxl to
    part_files: tuple[str, ...] = ()
    #: its sd-scripts script trains a flow model: the option that shifts its noise levels there and its default
    #: (FLUX.1's --discrete_flow_shift 3.0, SD3's --training_shift 1.0, musubi-tuner's --discrete_flow_shift 1.0);
    #: None: a DDPM script (SDXL's)
    sd_scripts_shift: tuple[str, float] | None = None
    #: its sd-scripts script trains with --guidance_scale (FLUX.1 [dev], guidance-distilled)
    sd_scripts_guidance: bool = False

    def facts(self) -> FamilyFacts:
        return FamilyFacts(default_architecture=self.default_architecture, channels_last=self.channels_last)


REGISTRY: tuple[Registered, ...] = (
    Registered("sdxl", "sdxl", "SDXL", "sdxl-base-1.0", channels_last=True, sd_scripts_prefix="sdxl_"),
    Registered("sd3", "sd3", "SD3", "sd3-medium", sd_scripts_prefix="sd3_", sd_scripts_shift=("training_shift", 1.0)),
    Registered("cogvideox", "cogvideox", "CogVideoX", "cogvideox-5b"),
    Registered("cogvideox-i2v", "cogvideox", "CogVideoXI2V", "cogvideox-5b-i2v"),
    Registered(
        "flux",
        "flux",
        "Flux",
        "flux-dev",
        sd_scripts_prefix="flux_",
        part_files=("ae", "clip_l", "t5xxl"),
        sd_scripts_shift=("discrete_flow_shift", 3.0),
        sd_scripts_guidance=True,
    ),
    Registered(
        "wan",
        "wan",
        "Wan",
        "wan2.1-t2v-1.3b",
        sd_scripts_prefix="wan_",
        part_files=("ae", "t5xxl"),
        sd_scripts_shift=("discrete_flow_shift", 1.0),
    ),
    Registered("wan-i2v", "wan", "WanI2V", "wan2.1-i2v-14b", part_files=("ae", "t5xxl")),
    Registered("zimage", "zimage", "ZImage", "z-image", part_files=("ae", "text_encoder")),
    Registered("krea2", "krea2", "Krea2", "krea2", part_files=("ae", "text_encoder")),
    Registered("qwen-image", "qwenimage", "QwenImage", "qwen-image", part_files=("ae", "text_encoder")),
    Registered("qwen-image-edit", "qwenimage", "QwenImageEdit", "qwen-image-edit", part_files=("ae", "text_encoder")),
    Registered("qwen-image-2.1", "qwenimage", "QwenImage21", "qwen-image-2.1", part_files=("ae", "text_encoder")),
    Registered(
        "qwen-image-2.1-edit", "qwenimage", "QwenImage21Edit", "qwen-image-2.1", part_files=("ae", "text_encoder")
    ),
    Registered("flux2", "flux2", "Flux2", "flux2-klein-4b", part_files=("ae", "text_encoder")),
    Registered("flux2-edit", "flux2", "Flux2Edit", "flux2-klein-4b", part_files=("ae", "text_encoder")),
)
#: the family of a config that names none
DEFAULT_FAMILY = REGISTRY[0].name


def names() -> list[str]:
    return [r.name for r in REGISTRY]


def row(name: str) -> Registered:
    for r in REGISTRY:
        if r.name == name:
            return r
    raise UsageError(f"Unknown model family {name!r}.", hint=f"Known families: {', '.join(sorted(names()))}.")


def family_facts() -> dict[str, FamilyFacts]:
    """What the config's validation checks of each family (passed to it as the validation context)."""
    return {r.name: r.facts() for r in REGISTRY}


def get_family(name: str) -> ModelFamily:
    r = row(name)
    return getattr(importlib.import_module(f"{__package__}.{r.module}"), r.cls)()


def all_families() -> list[ModelFamily]:
    return [get_family(r.name) for r in REGISTRY]


def sd_scripts_family(script: str | None = None) -> Registered | None:
    """The family an sd-scripts (or musubi-tuner) training script maps to, by its name's prefix; without a script,
    the first family with a prefix (SDXL's: sd-scripts' options alone are read as an SDXL run). None: no family's."""
    rows = [r for r in REGISTRY if r.sd_scripts_prefix is not None]
    if script is None:
        return rows[0]
    return next((r for r in rows if script.startswith(r.sd_scripts_prefix or "")), None)
