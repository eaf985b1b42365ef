"""Optimizers: AdamW (torch), AdamW and Adafactor for bf16 weights with stochastic rounding (ours), 8-bit AdamW
(bitsandbytes or torchao), 4-bit AdamW and the CPU-offload optimizer (torchao).

Why our own bf16 AdamW: a pure-bf16 full fine-tune (weights, grads and the
update all bf16) loses every update smaller than bf16's resolution (~0.4 % of
the weight), which at lr 1e-5 is most of them. Rounding stochastically keeps
the update right on average. torchao has such an optimizer, but it compiles
per parameter shape with torch.compile (~15 s a shape on a CPU) and draws its
rounding noise from an RNG that a checkpoint does not capture; this one is
plain PyTorch, and its noise is seeded from (seed, step, parameter), so a
resumed run rounds exactly as an uninterrupted one.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from ..config.schema import MemoryConfig
from ..errors import BackendUnavailable
from .fsdp import _local
from .pinned import pinning_through_budget


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down with probability given by the distance (unbiased)."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # adding uniform noise to the 16 bits bf16 drops, then truncating, rounds the magnitude up
    # with probability (dropped bits / 2^16); the sign bit is untouched
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW whose moments and update are fp32 while the weights stay bf16 (stochastically rounded)."""

    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        seed: int = 0,
        stochastic_rounding: bool = True,
    ):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self.stochastic_rounding = stochastic_rounding

    def load_state_dict(self, state_dict):
        # torch casts floating optimizer state to the parameter's dtype (bf16 here),
        # which would round the fp32 moments and break exact resume: restore them
        moments = {
            int(i): {k: v for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}
            for i, st in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, ms in moments.items():
            for k, v in ms.items():
                self.state[params[i]][k] = v.to(device=params[i].device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for gi, group in enumerate(self.param_groups):
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                step = int(st["step"].item())
                g = p.grad.float()
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
                w = p.float().mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - b1**step))
                if p.dtype == torch.bfloat16 and self.stochastic_rounding:
                    gen = torch.Generator(device=p.device).manual_seed(
                        (self.seed * 1_000_003 + step * 10_007 + gi * 1_009 + pi) % (2**63)
                    )
                    p.copy_(stochastic_round_bf16(w, gen))
                else:
                    p.copy_(w)
        return loss


class AdafactorBF16(torch.optim.Optimizer):
    """Adafactor (Shazeer and Stern, 2018) with the learning rate used as given (transformers' Adafactor with
    ``scale_parameter=False, relative_step=False, warmup_init=False`` and no first moment: what sd-scripts runs
    with --fused_backward_pass), its state fp32, its update rounded stochastically into bf16 weights.

    Why ours rather than transformers' Adafactor: that one rounds the fp32 update to nearest when it writes a
    bf16 weight, so at lr 1e-5 most updates vanish (sd-scripts patches in stochastic rounding for this reason),
    and any noise it drew would not be in a checkpoint. As AdamWBF16: noise seeded by (seed, step, parameter).
    """

    def __init__(
        self,
        params,
        lr=1e-5,
        decay_rate=-0.8,
        eps=(1e-30, 1e-3),
        clip_threshold=1.0,
        weight_decay=0.0,
        seed: int = 0,
        stochastic_rounding: bool = True,
    ):
        defaults = {
            "lr": lr,
            "decay_rate": decay_rate,
            "eps": tuple(eps),
            "clip_threshold": clip_threshold,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.seed = seed
        self.stochastic_rounding = stochastic_rounding

    def load_state_dict(self, state_dict):
        # as AdamWBF16: torch would cast the fp32 factors to the parameter's dtype
        factors = {
            int(i): {k: v for k, v in st.items() if k in ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col")}
            for i, st in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, fs in factors.items():
            for k, v in fs.items():
                self.state[params[i]][k] = v.to(device=params[i].device, dtype=torch.float32)

    @staticmethod
    def _rms(t: torch.Tensor) -> torch.Tensor:
        return t.norm(2) / (t.numel() ** 0.5)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for gi, group in enumerate(self.param_groups):
            lr, eps1 = group["lr"], group["eps"][0]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                factored = g.dim() >= 2
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    if factored:
                        st["exp_avg_sq_row"] = torch.zeros(g.shape[:-1], dtype=torch.float32, device=p.device)
                        st["exp_avg_sq_col"] = torch.zeros(
                            g.shape[:-2] + g.shape[-1:], dtype=torch.float32, device=p.device
                        )
                    else:
                        st["exp_avg_sq"] = torch.zeros_like(g)
                for k in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
                    if k in st and st[k].device != p.device:
                        # loaded while block swap kept the weight on the host: the state follows the weight to the
                        # device it steps on (once; then it stays)
                        st[k] = st[k].to(p.device)
                st["step"] += 1
                step = int(st["step"].item())
                beta2t = 1.0 - step ** group["decay_rate"]
                sq = g * g + eps1
                if factored:
                    row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(sq.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(sq.mean(dim=-2), alpha=1.0 - beta2t)
                    r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    update = r * col.unsqueeze(-2).rsqrt()
                    update.mul_(g)
                else:
                    v = st["exp_avg_sq"]
                    v.mul_(beta2t).add_(sq, alpha=1.0 - beta2t)
                    update = v.rsqrt().mul_(g)
                del sq, g
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                w = p.float()
                if group["weight_decay"]:
                    w.mul_(1 - lr * group["weight_decay"])
                w.sub_(update, alpha=lr)
                if p.dtype == torch.bfloat16 and self.stochastic_rounding:
                    gen = torch.Generator(device=p.device).manual_seed(
                        (self.seed * 1_000_003 + step * 10_007 + gi * 1_009 + pi) % (2**63)
                    )
                    p.copy_(stochastic_round_bf16(w, gen))
                else:
                    p.copy_(w)
        return loss


def _cuda_only(kind: str, params) -> None:
    # block swap keeps some weights in host memory (pinned, or pageable past memory.pinned_limit_gib): those count
    # as on the GPU's side; a run with no parameter on a CUDA GPU is refused
    if not any(p.is_cuda for p in params):
        raise BackendUnavailable(
            f"memory.optimizer {kind} runs on a CUDA GPU only.", hint="Use memory.optimizer.kind: adamw on this device."
        )


def _import(module: str, kind: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise BackendUnavailable(
            f"memory.optimizer {kind} needs {module.split('.')[0]}, which is not installed.",
            hint=f"pip install 'difftrain[{extra}]', or set memory.optimizer.kind: adamw",
        ) from None


def make_optimizer(
    mem: MemoryConfig, groups: list[dict], lr: float, seed: int = 0, kernels: dict | None = None
) -> torch.optim.Optimizer:
    """Build the configured optimizer over parameter groups ([{"params": [...], "lr": ...}]). ``kernels``: torch
    AdamW's implementation switches (``{"fused": True}``, ``{"foreach": True}``), from the speed section."""
    o = mem.optimizer
    params = [p for g in groups for p in g["params"]]
    if mem.fused_backward:
        return FusedBackward(mem, groups, lr, seed, kernels)
    if o.kind == "adafactor":
        return AdafactorBF16(
            groups,
            lr=lr,
            decay_rate=o.decay_rate,
            eps=o.eps,
            clip_threshold=o.clip_threshold,
            weight_decay=o.weight_decay,
            seed=seed,
            stochastic_rounding=o.bf16_stochastic_rounding,
        )
    common: dict[str, Any] = {"lr": lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if o.kind == "adamw8bit" and o.backend == "bnb":
        bnb = _import("bitsandbytes", "adamw8bit", "bnb")
        _cuda_only("adamw8bit", params)
        return without_syncs(bnb.optim.PagedAdamW8bit if o.paged else bnb.optim.AdamW8bit)(groups, **common)
    if o.kind == "adamw8bit" or o.kind == "adamw4bit":  # not `in`: mypy narrows o on == only
        ao = _import("torchao.optim", o.kind, "torchao")
        _cuda_only(o.kind, params)
        cls = ao.AdamW8bit if o.kind == "adamw8bit" else ao.AdamW4bit
        if mem.engine.kind == "fsdp":
            cls = local_shares(cls)
        return cls(groups, bf16_stochastic_round=any(p.dtype == torch.bfloat16 for p in params), **common)
    if o.kind == "cpu_offload":
        ao = _import("torchao.optim", "cpu_offload", "torchao")
        _cuda_only("cpu_offload", params)
        # the host-side AdamW runs fused on the CPU; weights stay on the GPU
        # with block swap some weights live on the host: every parameter must step there (torchao keeps the
        # ones under minimal_size on the device by default, which would mix devices in one optimizer)
        extra = {"minimal_size": 0} if mem.offload.kind == "block_swap" else {}
        with pinning_through_budget(importlib.import_module("torchao.optim.cpu_offload")):  # memory.pinned_limit_gib
            return ao.CPUOffloadOptimizer(
                groups, torch.optim.AdamW, offload_gradients=o.offload_gradients, fused=True, **common, **extra
            )
    if any(p.dtype == torch.bfloat16 for p in params):
        return AdamWBF16(groups, seed=seed, stochastic_rounding=o.bf16_stochastic_rounding, **common)
    return torch.optim.AdamW(groups, **common, **(kernels or {}))


def _no_sync(t: torch.Tensor) -> None:
    """bitsandbytes' sync_gpu, left out (without_syncs)."""


def syncs_needed(opt: torch.optim.Optimizer) -> bool:
    """Whether a bitsandbytes optimizer's step must wait for the device after each parameter: its paged state (moved
    by CUDA's unified memory, outside any stream's order), or a step run on another CUDA stream than the default one
    (bitsandbytes launches its updates on CUDA's legacy default stream)."""
    if getattr(opt, "is_paged", True):
        return True
    p = next((p for g in opt.param_groups for p in g["params"]), None)
    if p is None or p.device.type != "cuda":
        return p is not None and p.device.type != "cpu"  # on the CPU there is nothing to wait for either way
    return torch.cuda.current_stream(p.device) != torch.cuda.default_stream(p.device)


def without_syncs(base: type) -> type:
    """bitsandbytes' 8-bit AdamW ``base`` stepping without a device synchronisation after each parameter.

    Why not bitsandbytes' step as it is: bitsandbytes 0.50 calls ``torch.cuda.synchronize()`` after every
    parameter's update (optim/optimizer.py ``step``: ``sync_gpu(p)``), which only its paged state needs. Otherwise it
    just keeps the host from queuing ahead of the GPU: a LoRA of 200 tensors waits 200 times a step, the first wait
    for the whole backward, and the next step's forward is then launched onto an idle GPU (FLUX.2 [klein] 4B LoRA on
    an H200: 201 synchronisations, 170 of the step's 250 ms on the host waiting; benchmarks/fast_default.py --profile,
    DIFFTRAIN_PROFILE_PYTHON=1, docs/benchmarks.md). Its non-paged updates run on CUDA's legacy default stream, the
    stream the training step runs on (difftrain's side streams only copy weights, and wait on it), so they stay
    ordered after the backward and before the next forward without the waits; bitsandbytes' open pull request 2050
    takes the same syncs out for non-paged CUDA optimizers. ``syncs_needed`` keeps them for paged state and for a step
    on another stream."""

    class WithoutSyncs(base):  # a bitsandbytes optimizer class, given at run time
        @torch.no_grad()
        def step(self, closure=None):
            if syncs_needed(self):
                return super().step(closure)
            import bitsandbytes.optim.optimizer as bnb_optimizer

            real = bnb_optimizer.sync_gpu
            bnb_optimizer.sync_gpu = _no_sync
            try:
                return super().step(closure)
            finally:
                bnb_optimizer.sync_gpu = real

    WithoutSyncs.__name__ = WithoutSyncs.__qualname__ = base.__name__
    return WithoutSyncs


def local_shares(base: type) -> type:
    """torchao's low-bit AdamW ``base`` stepping each process's local shares of FSDP's sharded (DTensor) weights,
    with moments that are this process's own (quantized) tensors.

    Why not torchao's as it is: it wraps each quantized moment in a DTensor and compiles its step over DTensors,
    which dynamo in torch 2.11 cannot trace ("OptimState8bit dispatch: ... aten.view.dtype", found training
    Qwen-Image on 2 H200s). AdamW is elementwise, so the update of a local share from its local gradient and
    moments is the whole weight's update, cut; torchao's own compiled step function does it, per share."""

    class LocalShares(base):  # a torchao optimizer class, given at run time
        local_states = True  # memory/fsdp.py's load_shares: the moments are local tensors, not DTensors

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            local = _local(p)
            # as torchao's: only tensors of at least 4096 values, in whole blocks, are quantized
            if local.numel() >= 4096 and local.numel() % self.block_size == 0:
                return self._subclass_zeros(local, signed, self.block_size)
            return torch.zeros_like(local)

        @torch.no_grad()
        def step(self, closure=None):
            from torchao.optim.adam import single_param_adam

            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            # one compiled function per (shape, dtype) of share, as torchao's own step compiles per parameter
            with torch._dynamo.utils.disable_cache_limit():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p]
                        if len(state) == 0:
                            state["step"] = torch.tensor(0.0)
                            state["exp_avg"] = self._new_buffer(p, True)
                            state["exp_avg_sq"] = self._new_buffer(p, False)
                            if group["amsgrad"]:
                                state["max_exp_avg_sq"] = self._new_buffer(p, False)
                        state["step"] += 1
                        if not isinstance(group["lr"], torch.Tensor):
                            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
                        torch.compile(single_param_adam, fullgraph=True, dynamic=False)(
                            _local(p).detach(),
                            _local(p.grad),
                            state["step"],
                            state["exp_avg"],
                            state["exp_avg_sq"],
                            state.get("max_exp_avg_sq", None),
                            group["lr"],
                            group["betas"][0],
                            group["betas"][1],
                            group["weight_decay"],
                            group["eps"],
                            self.is_adamw,
                            self.bf16_stochastic_round and p.dtype is torch.bfloat16,
                        )
            return loss

    LocalShares.__name__ = LocalShares.__qualname__ = f"{base.__name__}LocalShares"
    return LocalShares


class FusedBackward(torch.optim.Optimizer):
    """Step each parameter inside backward, as soon as its gradient is accumulated, then free the gradient.

    Peak gradient memory becomes one parameter's instead of the whole model's
    (the technique of PyTorch's "optimizer step in backward" tutorial, and of
    sd-scripts' --fused_backward_pass). Each parameter gets its own inner
    optimizer of the configured kind; this object carries the parameter groups,
    so an LR scheduler built on it drives every inner optimizer. step() and
    zero_grad() are no-ops: the work happened during backward.
    """

    def __init__(self, mem: MemoryConfig, groups: list[dict], lr: float, seed: int = 0, kernels: dict | None = None):
        super().__init__(groups, {"lr": lr})
        inner_mem = mem.model_copy(update={"fused_backward": False})
        self.inner: dict[torch.Tensor, torch.optim.Optimizer] = {}  # by parameter, as the grad hook hands it back
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                # a distinct seed per parameter: stochastic rounding noise must not repeat across tensors
                self.inner[p] = make_optimizer(
                    inner_mem,
                    [{"params": [p], "lr": group["lr"]}],
                    group["lr"],
                    seed=seed * 100_003 + index,
                    kernels=kernels,
                )
                p.register_post_accumulate_grad_hook(self._hook(group))
                index += 1

    def _hook(self, group):
        def hook(p: torch.Tensor) -> None:
            opt = self.inner[p]
            opt.param_groups[0]["lr"] = group["lr"]
            opt.step()
            p.grad = None

        return hook

    def step(self, closure=None):
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self):
        return {
            "inner": [self.inner[p].state_dict() for g in self.param_groups for p in g["params"]],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        if len(state_dict["inner"]) != len(params):
            raise ValueError(f"fused-backward state has {len(state_dict['inner'])} parameters, expected {len(params)}")
        for p, sd in zip(params, state_dict["inner"]):
            self.inner[p].load_state_dict(sd)
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved)
