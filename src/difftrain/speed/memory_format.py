"""speed.channels_last: the UNet's convolutions in channels-last memory format (``auto`` is decided in ``auto``)."""

from __future__ import annotations

import torch


def channels_last(module: torch.nn.Module) -> None:
    module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs omit memory_format
