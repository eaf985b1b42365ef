"""What ``setup.build_parts`` hands the rest of the trainer: the loaded parts, what trains and what steps it
(``Parts``), and the wrappers a forward pass runs through (DDP, DeepSpeed's engine). Its own module so that the
checkpointer and the exporter read it without importing the setup, which imports them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .ema import EMA


@dataclass
class Parts:
    """The loaded components, what trains, and what steps it."""

    comps: dict[str, Any]  # every loaded part (and tokenizers), by name
    trained: dict[str, torch.nn.Module]  # the parts that train (LoRA-adapted or whole)
    params: list[torch.nn.Parameter]  # their trainable parameters, in optimizer order
    groups: list[dict]  # optimizer parameter groups (params, lr) per trained part
    block_swap: Any = None  # the denoiser's block swap, when memory.offload is block_swap
    engine: Any = None  # DeepSpeed's engine (it then owns the optimizer step)
    optimizer: Any = None
    wrapped: dict[str, torch.nn.Module] = field(default_factory=dict)  # DDP wrappers, for the forward passes only
    ema: EMA | None = None
    fsdp: bool = False  # the trained denoiser is sharded by FSDP2 (memory.engine fsdp)

    def forward_module(self, part: str) -> torch.nn.Module:
        """What a forward pass of ``part`` runs: its DDP wrapper on several processes, else the part."""
        w = self.wrapped.get(part)
        return w if w is not None else self.comps[part]

    def denoiser(self, name: str) -> Any:
        """The denoiser as the family runs it: through DeepSpeed's engine, a DDP wrapper, or as it is."""
        if self.engine is not None:
            return EngineView(self.engine, self.comps[name])
        return self.forward_module(name)

    def no_sync(self) -> contextlib.ExitStack:
        """DDP's no_sync on every wrapper: micro-batches before the last of an accumulation keep their gradients
        local."""
        stack = contextlib.ExitStack()
        for w in self.wrapped.values():
            stack.enter_context(w.no_sync())  # type: ignore[operator]  # DDP's no_sync, an untyped method
        if self.fsdp:
            from ..memory.fsdp import no_sync

            stack.enter_context(no_sync(list(self.trained.values())))
        return stack


class EngineView:
    """The DeepSpeed engine as the family sees the denoiser: calls run through the engine, attribute reads
    go to the model (the engine has a ``config`` of its own: DeepSpeed's, not the transformer's)."""

    def __init__(self, engine: Any, module: torch.nn.Module) -> None:
        self._engine, self._module = engine, module

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class DDP(DistributedDataParallel):
    """DDP whose attribute reads fall through to the wrapped module (family code reads ``.config``)."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)
