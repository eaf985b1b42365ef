"""EMA of the trained weights: ema <- decay * ema + (1 - decay) * weight, every N optimizer steps.

Ours rather than diffusers' EMAModel: that one keeps its copy on the weights'
device (no host-RAM option for a 2.6B-parameter UNet) and applies a hidden
decay warm-up; here the decay is exactly the configured one, so a user (and a
test) can compute the result by hand.
"""

from __future__ import annotations

import torch


class EMA:
    def __init__(
        self, named_params: dict[str, torch.nn.Parameter], decay: float, update_every: int = 1, device: str = "same"
    ):
        self.decay = decay
        self.update_every = update_every
        self.params = named_params
        self.device = None if device == "same" else torch.device(device)
        self.shadow = {
            n: p.detach().to(device=self.device or p.device, dtype=torch.float32, copy=True)
            for n, p in named_params.items()
        }
        if self.device is not None and self.device.type == "cpu" and torch.cuda.is_available():
            self.shadow = {n: t.pin_memory() for n, t in self.shadow.items()}

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Called after optimizer step ``step`` (1-based); updates every ``update_every`` steps."""
        if step % self.update_every:
            return False
        for n, p in self.params.items():
            s = self.shadow[n]
            s.lerp_(
                p.detach().to(s.device, torch.float32), 1 - self.decay
            )  # blocking: a GPU->host copy must land first
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if set(sd) != set(self.shadow):
            raise ValueError(f"EMA state has {len(sd)} tensors, expected {len(self.shadow)}")
        for n, t in sd.items():
            self.shadow[n].copy_(t)
