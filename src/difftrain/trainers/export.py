"""What training leaves behind: the LoRA file (diffusers layout, and kohya's where the family has it; LoHa and LoKr
in the kohya/LyCORIS layout alone, as diffusers loads neither) and full fine-tunes in ``save.formats``, from the
trained weights or their EMA.

On several processes the first one writes; the others take part in what is collective (ZeRO-3 gathers the
partitioned weights on every process) and write nothing.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config.schema import Config
from ..console import info
from ..families.base import ModelFamily
from ..lora.adapters import adapter_metadata, export_layers
from ..runtime import distributed as dist_
from ..utils import to_dtype
from .parts import Parts

LORA_FILE = "pytorch_lora_weights.safetensors"


class Exporter:
    def __init__(self, cfg: Config, family: ModelFamily, world: dist_.World, out: Path, parts: Parts) -> None:
        self.cfg, self.family, self.world, self.out, self.parts = cfg, family, world, out, parts

    @property
    def use_ema(self) -> bool:
        """ema.export: exports hold the EMA weights."""
        return self.parts.ema is not None and self.cfg.ema.export

    def metadata(self) -> dict[str, dict]:
        """Per trained part: its peft LoRA config (rank, alpha, targets), stored in the file header."""
        return {part: adapter_metadata(m) for part, m in self.parts.trained.items()}

    # ---------------------------------------------------------------- LoRA
    def layers(self) -> dict[str, dict[str, torch.Tensor]]:
        """The LoRA weights of every trained part, in peft naming (collective under ZeRO-3)."""
        from ..memory.deepspeed_engine import gathered

        p = self.parts
        with gathered(p.engine, p.params):  # ZeRO-3 partitions the LoRA weights too
            return {part: {n: t.detach().clone() for n, t in export_layers(m).items()} for part, m in p.trained.items()}

    def lora_layers(self, use_ema: bool) -> dict[str, dict[str, torch.Tensor]]:
        """The LoRA weights to write: the trained ones, or the EMA's (copied out while swapped in)."""
        if not use_ema:
            return self.layers()
        with self.ema_swapped():
            return {k: {n: t.clone() for n, t in v.items()} for k, v in self.layers().items()}

    def save_lora(self, folder: Path, use_ema: bool = False, layers: dict | None = None) -> None:
        """The family's diffusers LoRA file in ``folder`` (a checkpoint's copy of the LoRA); LoHa and LoKr, which
        diffusers does not load, as the kohya/LyCORIS file."""
        chosen = layers if layers is not None and not use_ema else self.lora_layers(use_ema)
        if self.cfg.lora.type != "lora":
            from ..lora import files as lora_files

            path = folder / lora_files.kohya_file(self.cfg)
            lora_files.write_kohya(path, self.cfg, self.family, chosen, self.metadata())
            return
        self.family.save_lora(folder, chosen, self.metadata())

    @contextmanager
    def ema_swapped(self) -> Iterator[None]:
        """Temporarily put the EMA weights into the (small, LoRA) trainable parameters."""
        ema = self.parts.ema
        assert ema is not None  # only called with ema.export
        backup = {n: p.detach().clone() for n, p in ema.params.items()}
        with torch.no_grad():
            for n, p in ema.params.items():
                p.copy_(ema.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in ema.params.items():
                    p.copy_(backup[n])

    def export_lora(self, path: Path) -> Path:
        """Write the LoRA as pytorch_lora_weights.safetensors (diffusers layout), atomically (the first process),
        and as kohya's file where the family has that layout and save.lora_formats asks for it."""
        if not self.world.main:
            if self.parts.engine is not None:
                self.layers()  # ZeRO-3's gathers are collective: take part, write nothing
            return path
        from ..lora import files as lora_files

        kinds = lora_files.formats(self.cfg, self.family)
        path.parent.mkdir(parents=True, exist_ok=True)
        layers = self.lora_layers(self.use_ema)
        meta = self.metadata()
        if "kohya" in kinds:  # first: a layer the kohya names cannot express stops before any file is replaced
            lora_files.write_kohya(path.parent / lora_files.kohya_file(self.cfg), self.cfg, self.family, layers, meta)
        if "diffusers" in kinds:
            with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as tmp:
                self.family.save_lora(Path(tmp), layers, meta)
                lora_files.add_metadata(Path(tmp) / LORA_FILE, lora_files.metadata(self.cfg, self.family, meta))
                os.replace(Path(tmp) / LORA_FILE, path)  # same folder, so the rename is atomic
        return path if "diffusers" in kinds else path.parent / lora_files.kohya_file(self.cfg)

    # ---------------------------------------------------------------- full fine-tunes
    def _collective_only(self) -> list[Path]:
        """Not the first process: take part in ZeRO-3's gathers (collective), write nothing."""
        from ..memory.deepspeed_engine import gathered

        for m in self.parts.trained.values():
            if self.parts.fsdp:
                from ..memory.fsdp import full_model_state

                full_model_state(m, main=False)  # the gather is collective; the first process keeps the result
            elif self.parts.engine is not None:
                with gathered(self.parts.engine, list(m.parameters())):
                    pass
        return []

    def _state_dicts(
        self, modules: dict[str, torch.nn.Module], dtype: torch.dtype | None = None
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Each part's weights to write: gathered from ZeRO-3's shares, the EMA's for trained parts if asked."""
        from ..memory.deepspeed_engine import gathered

        p, sds = self.parts, {}
        for part, m in modules.items():
            if p.fsdp and part in p.trained:
                from ..memory.fsdp import full_model_state

                # cast as gathered (FSDP's master weights are fp32): the export's dtype, one tensor at a time
                sd = full_model_state(m, main=True, dtype=dtype)
            elif p.engine is not None and part in p.trained:
                with gathered(p.engine, list(m.parameters())):
                    sd = {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()}
            else:
                sd = m.state_dict()
            if part in p.trained and self.use_ema:
                assert p.ema is not None
                sd.update({n[len(part) + 1 :]: t for n, t in p.ema.shadow.items() if n.startswith(part + ".")})
            sds[part] = sd
        return sds

    def export_model(self, tag: str | None) -> list[Path]:
        """Write the fine-tuned model in save.formats at save.precision (EMA weights if asked).

        Parts that training did not load (the VAE, frozen text encoders) are read
        from the base model for the export and freed after it.
        """
        sv, fam = self.cfg.save, self.family
        if not sv.formats:  # nothing to write: the VAE and text encoders are not loaded for it either
            return []
        if not self.world.main:
            return self._collective_only()
        dest = self.out if tag is None else self.out / "saved" / tag
        dtype = to_dtype(sv.precision)
        names = (fam.denoiser, fam.image_encoder, *fam.text_encoders)
        if "diffusers" not in sv.formats:  # only the parts the single file holds (Flux: the transformer alone)
            names = fam.single_file_parts(list(self.parts.trained))
        comps = self.parts.comps
        missing = [p for p in names if p not in comps]
        extra = fam.load(self.cfg.model, missing, dtype=dtype, device="cpu") if missing else {}
        modules = {p: comps[p] if p in comps else extra[p] for p in names}
        sds = self._state_dicts(modules, dtype)
        configs = fam.module_configs(modules)
        out = []
        if "single_file" in sv.formats:
            keep = fam.single_file_parts(list(self.parts.trained))
            out.append(
                fam.save_single_file(
                    {p: sd for p, sd in sds.items() if p in keep}, configs, dest / "model.safetensors", dtype=dtype
                )
            )
        if "diffusers" in sv.formats:
            out.append(fam.save_diffusers(sds, configs, dest / "diffusers", self.cfg.model, dtype=dtype))
        del extra, sds
        info(f"saved {', '.join(str(p) for p in out)}")
        return out
