"""A part's weights set into its module one tensor at a time, each sent where it will live as it is read.

Every loader builds its part on the meta device and reads the file one tensor at a time. Without a placement
the tensors are gathered and assigned (``common.assign_state_dict``), as they always were: on the GPU they went
there one at a time, on the host the model is host memory anyway. With a placement (the trainer's, for the parts
it stores in fp8 and the denoiser it swaps block by block: ``memory.placement``) each tensor goes to its
destination before the next is read (fp8 on the GPU, a pinned block-swap slab ...), so the high-precision model
is never whole in host memory: FLUX.1's 22 GiB transformer took 24 GiB of host RAM on a 24 GB-card recipe before
(issue 50).

The placement is set for the duration of the load (``placing``) rather than passed down: every family's ``load``
and its layouts (diffusers folder, single files) reach :func:`fill` through the shared readers, and the families
need not know the memory techniques (they may not import them: the import contracts in pyproject.toml); the
trainer's placement (``memory.placement.WeightPlacement``) has this module's :class:`Placement` shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

#: sets one tensor (name in the part's state dict, as read at its loaded dtype) into the part's module
Put = Callable[[torch.nn.Module, str, torch.Tensor], None]


class Placement(Protocol):
    def takes(self, part: str) -> bool:
        """Whether the placement puts ``part``'s tensors (else the part loads as usual)."""
        ...

    def put_for(self, part: str, module: torch.nn.Module) -> Put:
        """The Put for ``part``, whose module (on the meta device) is ``module``."""
        ...


@dataclass
class _State:
    placement: Placement | None = None
    placed: set[str] = field(default_factory=set)  # parts the placement set, which stay where it put them


_STATE = _State()


@contextlib.contextmanager
def placing(placement: Placement | None) -> Iterator[set[str]]:
    """Within it, loads send each tensor of a part the placement takes where it says. Yields the set of the parts
    it placed (filled in as they load): their tensors are where they belong, so nothing moves them afterwards."""
    saved = (_STATE.placement, _STATE.placed)
    _STATE.placement, _STATE.placed = placement, set()
    try:
        yield _STATE.placed
    finally:
        _STATE.placement, _STATE.placed = saved


def is_placed(part: str) -> bool:
    """Whether ``part`` was set by the placement of the load in progress (``common.freeze`` leaves it in place)."""
    return part in _STATE.placed


def takes(part: str) -> bool:
    """Whether the placement in force (if any) puts ``part``'s tensors."""
    return _STATE.placement is not None and _STATE.placement.takes(part)


def fill(
    module: torch.nn.Module,
    part: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    mismatch: Callable[[str], Exception],
    assign: Callable[[torch.nn.Module, dict, Callable[[str], Exception]], None],
) -> None:
    """Set the (name, tensor) pairs into ``module`` (built on the meta device).

    With a placement for ``part`` in force, each pair is checked against the module and put where the placement
    says before the next is read; else they are gathered and handed to ``assign`` (``common.assign_state_dict``).
    Either way a name the module lacks, a wrong shape or a weight the file lacks raises ``mismatch(what)``, in
    load_state_dict's words."""
    if _STATE.placement is None or not _STATE.placement.takes(part):
        assign(module, dict(tensors), mismatch)
        return
    put = _STATE.placement.put_for(part, module)
    expected = {n: tuple(t.shape) for n, t in module.state_dict(keep_vars=True).items()}
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, t in tensors:
        shape = expected.get(name)
        if shape is None:
            unexpected.append(name)
            continue
        if tuple(t.shape) != shape:
            raise mismatch(
                f"size mismatch for {name}: copying a param with shape {torch.Size(t.shape)} from checkpoint, "
                f"the shape in current model is {torch.Size(shape)}."
            )
        put(module, name, t)
        seen.add(name)
        del t  # the host copy goes as soon as its destination has it
    check_complete(module, [n for n in expected if n not in seen], unexpected, mismatch)
    _STATE.placed.add(part)


def check_complete(
    module: torch.nn.Module, missing: list[str], unexpected: list[str], mismatch: Callable[[str], Exception]
) -> None:
    """``mismatch(what)`` for names the file lacks (transformers' position ids aside, which the model makes) or the
    module lacks, and for a weight still on the meta device: a filled part is complete, gathered or streamed."""
    missing = [m for m in missing if not m.endswith("position_ids")]
    if missing or unexpected:
        raise mismatch(f"missing {missing[:3]}, unexpected {unexpected[:3]}.")
    empty = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if empty:
        raise mismatch(f"no weights for {empty[:3]}.")
