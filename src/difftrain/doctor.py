"""difftrain doctor: what this machine has, what works on it, and what to do where something does not.

Each check is a line: status (ok / warn / fail / info), what was found, and, when it is not ok, the next
thing to do. Optional engines are imported and given a tiny operation, so "installed but broken" (a
bitsandbytes without its CUDA library, a DeepSpeed built for another torch) shows here rather than an
hour into a run. Nothing here loads a model.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from dataclasses import dataclass

from . import distributed as dist_


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | info
    found: str
    fix: str = ""


def _version(mod: str) -> str | None:
    try:
        m = importlib.import_module(mod)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return None
    return getattr(m, "__version__", "?")


def host_ram_gib() -> tuple[float | None, float | None]:
    """(total, available) GiB from /proc/meminfo (Linux), else psutil when present."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info[k] = int(v.split()[0]) / 2**20
        return info.get("MemTotal"), info.get("MemAvailable")
    except OSError:
        try:
            import psutil

            vm = psutil.virtual_memory()
            return vm.total / 2**30, vm.available / 2**30
        except ImportError:
            return None, None


def checks(platform_name: str = sys.platform) -> list[Check]:
    import torch

    out = [Check("python", "ok" if sys.version_info >= (3, 10) else "fail", platform.python_version(),
                 "" if sys.version_info >= (3, 10) else "Use Python 3.10 or newer.")]
    cuda = torch.cuda.is_available()
    out.append(Check("torch", "ok", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"))
    if cuda:
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append(Check(f"gpu {i}", "ok", f"{torch.cuda.get_device_name(i)}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"))
        drv = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
        if drv:
            out.append(Check("cuda driver", "ok", f"{drv // 1000}.{drv % 1000 // 10}"))
    else:
        out.append(Check("gpu", "warn", "no CUDA GPU visible to torch",
                         "Training runs on the CPU (slowly). For a GPU: the CUDA build of torch (README: GPU set-up) and "
                         "an NVIDIA driver; check CUDA_VISIBLE_DEVICES."))
    total, avail = host_ram_gib()
    if total is not None:
        out.append(Check("host ram", "ok" if avail is None or avail > 8 else "warn", f"{avail:.1f} of {total:.1f} GiB available",
                         "" if avail is None or avail > 8 else "Little host RAM is free: close other programs before loading a model."))
    for mod, label in (("diffusers", "diffusers"), ("transformers", "transformers"), ("peft", "peft"), ("accelerate", "accelerate")):
        v = _version(mod)
        out.append(Check(label, "ok" if v else "fail", v or "does not import", "" if v else f"pip install {mod}"))
    out += [_bitsandbytes(cuda), _deepspeed(cuda), _torchao(), _optional("xformers", "pip install xformers (optional; SDPA is used without it)", missing="info"),
            _optional("av", "pip install 'difftrain[video]' (PyAV: video datasets)"),
            _optional("tensorboard", "pip install tensorboard (report.to: [tensorboard])"),
            _optional("wandb", "pip install wandb (only for report.to: [wandb])", missing="info")]
    out += distributed_checks(platform_name)
    return out


def _optional(mod: str, fix: str, missing: str = "warn") -> Check:
    v = _version(mod)
    return Check(mod, "ok" if v else missing, v or "not installed", "" if v else fix)


def _bitsandbytes(cuda: bool) -> Check:
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001
        return Check("bitsandbytes", "warn", f"does not import ({type(e).__name__})",
                     "pip install 'difftrain[bnb]' (8-bit Adam, nf4/int8 weights, T5 in 8 bit)")
    if not cuda:
        return Check("bitsandbytes", "info", f"{bnb.__version__} (its optimizers and quantized layers need a CUDA GPU)")
    try:
        import torch

        p = torch.nn.Parameter(torch.ones(64, device="cuda"))
        opt = bnb.optim.AdamW8bit([p], lr=1e-3)
        p.grad = torch.ones_like(p)
        opt.step()
        return Check("bitsandbytes", "ok", f"{bnb.__version__}: AdamW8bit steps on the GPU")
    except Exception as e:  # noqa: BLE001
        return Check("bitsandbytes", "fail", f"{bnb.__version__}: AdamW8bit fails: {str(e).splitlines()[0][:120]}",
                     "Reinstall bitsandbytes for this CUDA (python -m bitsandbytes prints its diagnosis).")


def _deepspeed(cuda: bool) -> Check:
    v = _version("deepspeed")
    if v is None:
        return Check("deepspeed", "warn", "not installed",
                     "pip install --no-build-isolation deepspeed (after torch) for memory.engine deepspeed (ZeRO 2/3)")
    return Check("deepspeed", "ok" if cuda else "info", v + ("" if cuda else " (ZeRO runs on CUDA GPUs only)"))


def _torchao() -> Check:
    try:
        from torchao.optim import AdamW8bit  # noqa: F401 - the import path difftrain uses (it moved between releases)

        return Check("torchao", "ok", f"{_version('torchao')}: torchao.optim imports")
    except Exception as e:  # noqa: BLE001
        return Check("torchao", "warn", f"torchao.optim does not import ({type(e).__name__})",
                     "pip install 'difftrain[torchao]' (CPU-offload AdamW, 4-bit Adam, fp8)")


def distributed_checks(platform_name: str = sys.platform) -> list[Check]:
    """The process-group backends, the TCP store's libuv, and what difftrain does about them."""
    import torch
    import torch.distributed as dist

    out = []
    gloo = dist.is_available() and dist.is_gloo_available()
    nccl = dist.is_available() and dist.is_nccl_available()
    out.append(Check("gloo", "ok" if gloo else "fail", "available" if gloo else "missing",
                     "" if gloo else "This torch build cannot run several processes: install an official build."))
    if torch.cuda.is_available():
        out.append(Check("nccl", "ok" if nccl else "warn", "available" if nccl else "missing (Windows and macOS builds have none)",
                         "" if nccl else "--gpus N runs on gloo here: it works, with slower gradient exchange."))
    else:
        out.append(Check("nccl", "info", "not used without a CUDA GPU: several processes run on gloo"))
    if dist_.has_libuv(platform_name):
        out.append(Check("libuv", "ok", "torch's TCP store can use libuv"))
    else:
        out.append(Check("libuv", "info", f"none on {platform_name}: difftrain's launcher sets USE_LIBUV=0 for torchrun's store",
                         "If you start torchrun yourself, set USE_LIBUV=0 first."))
    out.append(Check("ddp buckets", "info", f"gradient buckets capped under 2^31 elements ({dist_.INT32_MAX:,})"))
    return out


def recipe_fit(cfg) -> Check:
    """Whether a config's planned peak fits this machine's free GPU memory."""
    import torch

    from .trainers.loop import plan_memory

    plan = plan_memory(cfg)
    need = plan.gpu_reserved
    if not torch.cuda.is_available():
        return Check("fits", "info", f"plan: {need:.1f} GiB of GPU memory (no GPU here to compare with)")
    free = torch.cuda.mem_get_info()[0] / 2**30
    ok = need <= free
    return Check("fits", "ok" if ok else "fail", f"plan: {need:.1f} GiB of GPU memory, {free:.1f} GiB free",
                 "" if ok else f"`difftrain plan --vram {free:.0f}GiB` lists settings predicted to fit.")


def environment_lines() -> list[str]:
    env = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "USE_LIBUV", "WORLD_SIZE") if k in os.environ}
    return [f"{k}={v}" for k, v in env.items()]
