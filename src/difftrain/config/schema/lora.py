"""``lora``: the adapter a LoRA run trains.

``type`` picks the adapter as sd-scripts' LyCORIS network does with ``--network_args algo=...``: ``lora`` (sd-scripts'
``networks.lora``, or LyCORIS' ``algo=lora`` / ``locon``), ``loha`` (``algo=loha``: LoHa, the Hadamard product of two
low-rank products) or ``lokr`` (``algo=lokr``: LoKr, a Kronecker product). ``use_dora`` is DoRA (LyCORIS'
``dora_wd=True``; sd-scripts-derived trainers' ``use_dora``) on the LoRA. What each sd-scripts / LyCORIS argument is here:

    --network_module networks.lora | lycoris.kohya       -> (nothing; the adapter is lora.type)
    --network_args algo=lora | locon | loha | lokr        -> lora.type: lora | lora | loha | lokr
    --network_args dora_wd=True (or use_dora=True)        -> lora.use_dora: true (lora.type lora only)
    --network_args factor=N                               -> lora.factor: N (lokr)
    --network_args decompose_both=True                    -> lora.decompose_both: true (lokr)
    --network_args full_matrix=True                       -> lora.full_matrix: true (lokr)
    --network_args rank_dropout=P module_dropout=P        -> lora.rank_dropout / lora.module_dropout (loha, lokr)
    --network_args use_tucker=True (or use_cp=True)       -> lora.use_tucker: true (loha; lokr's is refused)
    --network_dim / --network_alpha                       -> lora.rank / lora.alpha

lora.init applies to LoRA and DoRA; LoHa and LoKr start as peft starts them (one factor zero, so ΔW = 0).

All of it is peft's (LoHaConfig, LoKrConfig, LoraConfig(use_dora=True)); lycoris-lora itself is not on the package
index difftrain installs from, and peft computes the same weights (the files are written in LyCORIS' names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from .base import Strict


class LoraConfig(Strict):
    rank: int = Field(default=16, ge=1)
    alpha: float | None = Field(default=None, gt=0, description="default: rank")
    dropout: float = Field(default=0.0, ge=0, lt=1)
    targets: list[str] = Field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    init: Literal["gaussian", "default"] = "gaussian"
    init_weights: Path | None = Field(
        default=None,
        description="a LoRA file (diffusers or kohya layout) to continue training "
        "from; its rank, alpha and layers must match this config",
    )
    type: Literal["lora", "loha", "lokr"] = Field(
        default="lora",
        description="the adapter (sd-scripts / LyCORIS network_args algo=): lora, loha (LyCORIS LoHa) or lokr "
        "(LyCORIS LoKr); loha and lokr are written in the kohya/LyCORIS layout only (diffusers does not load them)",
    )
    use_dora: bool = Field(
        default=False,
        description="DoRA (LyCORIS dora_wd=True): a learned magnitude per output row on top of the LoRA; "
        "lora.type lora only",
    )
    factor: int = Field(
        default=-1,
        description="lokr: the Kronecker factor (LyCORIS factor=); -1: the two factors as near the square root as "
        "the layer's sizes allow",
    )
    decompose_both: bool = Field(
        default=False, description="lokr: the first Kronecker factor low-rank as well (LyCORIS decompose_both=True)"
    )
    full_matrix: bool = Field(
        default=False,
        description="lokr: both Kronecker factors full matrices, lora.rank unused (LyCORIS full_matrix=True)",
    )

    use_tucker: bool = Field(
        default=False,
        description="loha: a convolution with a kernel larger than 1x1 as Tucker cores and factors "
        "(LyCORIS use_tucker=True, hada_t1 / hada_t2; peft's use_effective_conv2d)",
    )
    rank_dropout: float = Field(
        default=0.0, ge=0, lt=1, description="loha / lokr: dropout of ΔW's output rows (LyCORIS rank_dropout=)"
    )
    module_dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="loha / lokr: the chance a layer's adapter is skipped in a step (LyCORIS module_dropout=)",
    )

    @model_validator(mode="after")
    def _adapter(self):
        if self.use_dora and self.type != "lora":
            raise ValueError(
                f"lora.use_dora with lora.type {self.type}: peft's LoHa and LoKr have no weight decomposition "
                "(LyCORIS' dora_wd on loha/lokr); use lora.type: lora with use_dora, or drop use_dora"
            )
        lycoris_only = [k for k in ("rank_dropout", "module_dropout", "use_tucker") if getattr(self, k)]
        if lycoris_only and self.type == "lora":
            raise ValueError(
                f"lora.{', lora.'.join(lycoris_only)} with lora.type lora: peft's LoRA has no rank or module dropout "
                "(lora.dropout is its input dropout) nor Tucker form; they apply to loha and lokr"
            )
        lokr_only = [k for k in ("decompose_both", "full_matrix") if getattr(self, k)]
        if self.factor != -1:
            lokr_only.insert(0, "factor")
        if lokr_only and self.type != "lokr":
            raise ValueError(f"lora.{', lora.'.join(lokr_only)} only apply to lora.type: lokr (this is {self.type})")
        if self.factor == 0 or self.factor < -1:
            raise ValueError(f"lora.factor {self.factor}: a Kronecker factor is a positive size, or -1 (automatic)")
        if self.use_tucker and self.type == "lokr":
            raise ValueError(
                "lora.use_tucker with lora.type lokr: ComfyUI and Forge rebuild a LoKr's Tucker factor (lokr_t2) "
                "into a strided tensor that torch.kron refuses, so those layers would not load; use_tucker with "
                "lora.type loha, or lokr without it"
            )
        if self.full_matrix and self.decompose_both:
            raise ValueError("lora.full_matrix and lora.decompose_both contradict each other: keep one")
        if self.dropout and self.type != "lora":
            raise ValueError(
                f"lora.dropout with lora.type {self.type}: peft's LoHa and LoKr have no input dropout "
                "(sd-scripts' network_dropout); set lora.dropout: 0"
            )
        return self

    @property
    def plain(self) -> bool:
        """A plain LoRA (lora_A / lora_B only): what diffusers, the fused kernel and lora resize take as they are."""
        return self.type == "lora" and not self.use_dora
