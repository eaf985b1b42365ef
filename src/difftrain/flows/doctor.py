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

from ..errors import DifftrainError
from ..runtime import distributed as dist_


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

    from .. import __version__

    out = [
        Check("difftrain", "ok", __version__),
        Check(
            "python",
            "ok" if sys.version_info >= (3, 10) else "fail",
            platform.python_version(),
            "" if sys.version_info >= (3, 10) else "Use Python 3.10 or newer.",
        ),
    ]
    cuda = torch.cuda.is_available()
    out.append(Check("torch", "ok", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"))
    if cuda:
        for i in range(torch.cuda.device_count()):
            free, gpu_total = torch.cuda.mem_get_info(i)
            out.append(
                Check(
                    f"gpu {i}",
                    "ok",
                    f"{torch.cuda.get_device_name(i)}: {free / 2**30:.1f} of {gpu_total / 2**30:.1f} GiB free",
                )
            )
        drv = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
        if drv:
            out.append(Check("cuda driver", "ok", f"{drv // 1000}.{drv % 1000 // 10}"))
    else:
        out.append(
            Check(
                "gpu",
                "warn",
                "no CUDA GPU visible to torch",
                "Training runs on the CPU (slowly). For a GPU: the CUDA build of torch (README: GPU set-up) and "
                "an NVIDIA driver; check CUDA_VISIBLE_DEVICES.",
            )
        )
    total, avail = host_ram_gib()
    if total is not None:
        out.append(
            Check(
                "host ram",
                "ok" if avail is None or avail > 8 else "warn",
                # a kernel older than 3.14 has no MemAvailable line: the total alone
                f"{avail:.1f} of {total:.1f} GiB available" if avail is not None else f"{total:.1f} GiB",
                ""
                if avail is None or avail > 8
                else "Little host RAM is free: close other programs before loading a model.",
            )
        )
    for mod, label in (
        ("diffusers", "diffusers"),
        ("transformers", "transformers"),
        ("peft", "peft"),
        ("accelerate", "accelerate"),
    ):
        v = _version(mod)
        out.append(Check(label, "ok" if v else "fail", v or "does not import", "" if v else f"pip install {mod}"))
    capability = torch.cuda.get_device_capability(0) if cuda else None
    out += [
        _bitsandbytes(cuda),
        _deepspeed(cuda),
        _torchao(cuda),
        _fp8(capability),
        _xformers(cuda),
        _flash_attention_4(capability),
        _optional("av", "pip install 'difftrain[video]' (PyAV: video datasets)"),
        _optional("tensorboard", "pip install tensorboard (report.to: [tensorboard])"),
        _optional("wandb", "pip install wandb (only for report.to: [wandb])", missing="info"),
    ]
    out += distributed_checks(platform_name)
    return out


def _optional(mod: str, fix: str, missing: str = "warn") -> Check:
    v = _version(mod)
    return Check(mod, "ok" if v else missing, v or "not installed", "" if v else fix)


def _bitsandbytes(cuda: bool) -> Check:
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001
        return Check(
            "bitsandbytes",
            "warn",
            f"does not import ({type(e).__name__})",
            "pip install 'difftrain[bnb]' (8-bit Adam, nf4/int8 weights, T5 in 8 bit)",
        )
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
        return Check(
            "bitsandbytes",
            "fail",
            f"{bnb.__version__}: AdamW8bit fails: {str(e).splitlines()[0][:120]}",
            "Reinstall bitsandbytes for this CUDA (python -m bitsandbytes prints its diagnosis).",
        )


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def _adam_step(opt_class, device: str, n: int = 64, **kw) -> None:
    """One step of ``opt_class`` on an ``n``-element weight; raises unless the weight moved."""
    import torch

    p = torch.nn.Parameter(torch.ones(n, device=device))
    opt = opt_class([p], lr=1e-2, **kw)
    p.grad = torch.ones_like(p)
    opt.step()
    if not bool((p.detach() < 1).all()):
        raise RuntimeError("the step left the weight unchanged")


_DS_REINSTALL = (
    "Reinstall DeepSpeed for this torch: pip install --no-build-isolation --force-reinstall deepspeed "
    "(`ds_report` says what is missing)."
)


def _deepspeed(cuda: bool) -> Check:
    """Import DeepSpeed; step its CPU Adam (ZeRO-Offload's optimizer) when the op is prebuilt, else only ask whether it
    could be built: a first JIT build takes a minute or more."""
    v = _version("deepspeed")
    if v is None:
        return Check(
            "deepspeed",
            "warn",
            "not installed",
            "pip install --no-build-isolation deepspeed (after torch) for memory.engine deepspeed (ZeRO 2/3)",
        )
    gpu = "" if cuda else " (ZeRO runs on CUDA GPUs only)"
    try:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder import CPUAdamBuilder

        if not installed_ops.get("cpu_adam"):
            if CPUAdamBuilder().is_compatible(verbose=False):
                return Check(
                    "deepspeed",
                    "info",
                    f"{v}{gpu}: DeepSpeedCPUAdam (offload_optimizer_device: cpu) is built on "
                    "its first use (a minute or more; needs g++ and ninja)",
                    "To build it once, ahead: DS_BUILD_CPU_ADAM=1 pip install --no-build-isolation --force-reinstall deepspeed",
                )
            return Check(
                "deepspeed",
                "warn",
                f"{v}{gpu}: DeepSpeedCPUAdam cannot be built on this machine",
                "ZeRO without offload_optimizer_device: cpu still works; for the CPU optimizer install g++ and ninja, "
                "then DS_BUILD_CPU_ADAM=1 pip install --no-build-isolation --force-reinstall deepspeed",
            )
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        _adam_step(DeepSpeedCPUAdam, "cpu")
        return Check("deepspeed", "ok" if cuda else "info", f"{v}{gpu}: DeepSpeedCPUAdam steps (prebuilt op)")
    except Exception as e:  # noqa: BLE001 - a broken build fails in many ways
        return Check("deepspeed", "fail", f"{v}: {_first_line(e)}", _DS_REINSTALL)


def _torchao(cuda: bool, device: str = "cuda") -> Check:
    """Import torchao.optim; on a GPU, one AdamW8bit step (4096 weights: the quantized path; the first step compiles)."""
    try:
        from torchao.optim import AdamW8bit  # the import path difftrain uses (it moved between releases)
    except Exception as e:  # noqa: BLE001
        return Check(
            "torchao",
            "warn",
            f"torchao.optim does not import ({type(e).__name__})",
            "pip install 'difftrain[torchao]' (CPU-offload AdamW, 4-bit Adam, fp8)",
        )
    v = _version("torchao")
    if not cuda:
        return Check("torchao", "info", f"{v}: torchao.optim imports (its 8/4-bit AdamW steps on CUDA GPUs)")
    try:
        _adam_step(AdamW8bit, device, n=4096)
    except Exception as e:  # noqa: BLE001
        return Check(
            "torchao",
            "fail",
            f"{v}: AdamW8bit fails: {_first_line(e)}",
            "Install the torchao built for this torch (pip install -U torchao; its steps need torch.compile, "
            "i.e. triton and a C compiler), or use memory.optimizer adamw8bit with backend bnb.",
        )
    return Check("torchao", "ok", f"{v}: AdamW8bit steps on the GPU")


def _fp8(capability: tuple[int, int] | None, device: str = "cuda") -> Check:
    """float8 tensors on the device (what memory.weights fp8 stores), and whether it has float8 matmuls (8.9+)."""
    import torch

    where = device if capability else "cpu"
    try:
        x = torch.linspace(-2, 2, 16, device=where)
        if not torch.allclose(x.to(torch.float8_e4m3fn).float(), x, atol=0.13):
            raise RuntimeError("float8 round trip is off")
    except Exception as e:  # noqa: BLE001
        return Check(
            "fp8",
            "fail",
            f"float8 tensors fail on {where}: {_first_line(e)}",
            "Use torch 2.4 or newer, or memory.weights bf16.",
        )
    if capability is None:
        return Check(
            "fp8",
            "info",
            "no GPU: memory.weights fp8 stores weights in 1 byte and computes in bf16 "
            "(float8 matmuls need compute capability 8.9+)",
        )
    cc = f"{capability[0]}.{capability[1]}"
    if tuple(capability) >= (8, 9):
        return Check("fp8", "ok", f"compute capability {cc}: float8 tensors and matmuls (memory.weights fp8)")
    return Check(
        "fp8",
        "info",
        f"compute capability {cc}: float8 tensors work (memory.weights fp8 stores weights in 1 byte, "
        "computes in bf16); float8 matmuls need 8.9+ (Ada, Hopper)",
    )


def _xformers(cuda: bool, device: str = "cuda") -> Check:
    """If installed: memory_efficient_attention on tiny tensors on the GPU (difftrain itself uses SDPA)."""
    v = _version("xformers")
    if v is None:
        return Check("xformers", "info", "not installed", "pip install xformers (optional; SDPA is used without it)")
    if not cuda:
        return Check("xformers", "info", f"{v} (its kernels run on CUDA GPUs only)")
    try:
        import torch
        import xformers.ops as xops

        q = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)  # batch, tokens, heads, head dim
        out = xops.memory_efficient_attention(q, q, q)
        if tuple(out.shape) != tuple(q.shape) or not bool(torch.isfinite(out).all()):
            raise RuntimeError(f"wrong output {tuple(out.shape)}")
    except Exception as e:  # noqa: BLE001
        return Check(
            "xformers",
            "warn",
            f"{v}: memory_efficient_attention fails: {_first_line(e)}",
            "Install the xformers wheel built for this torch and CUDA, or uninstall it (difftrain uses PyTorch's SDPA).",
        )
    return Check("xformers", "ok", f"{v}: memory_efficient_attention runs on the GPU")


def _flash_attention_4(capability: tuple[int, int] | None, device: str = "cuda") -> Check:
    """flash-attn-4 (speed.attention auto's choice where it runs): whether this GPU can use it, and whether it does."""
    from ..speed import fa4

    fix = "pip install flash-attn-4 (speed.attention auto then uses it: CogVideoX-2b LoRA steps 1.2x on an H100)"
    if capability is None:
        return Check("flash-attn-4", "info", "runs on compute capability 9.x and 10.x (Hopper, Blackwell); no CUDA GPU")
    if (problem := fa4.capability_problem(capability)) is not None:
        return Check("flash-attn-4", "info", problem)
    if not fa4.installed():
        return Check("flash-attn-4", "info", "not installed", fix)
    import torch

    try:
        fa4.check(torch.device(device))
    except DifftrainError as e:
        return Check(
            "flash-attn-4",
            "warn",
            f"installed, but does not run here: {e.message}",
            "Install the flash-attn-4 build for this torch and CUDA, or uninstall it (speed.attention auto then "
            "uses torch's SDPA).",
        )
    return Check("flash-attn-4", "ok", "runs on this GPU: speed.attention auto uses it for long attention")


def distributed_checks(platform_name: str = sys.platform) -> list[Check]:
    """The process-group backends, the TCP store's libuv, and what difftrain does about them."""
    import torch
    import torch.distributed as dist

    out = []
    gloo = dist.is_available() and dist.is_gloo_available()
    nccl = dist.is_available() and dist.is_nccl_available()
    out.append(
        Check(
            "gloo",
            "ok" if gloo else "fail",
            "available" if gloo else "missing",
            "" if gloo else "This torch build cannot run several processes: install an official build.",
        )
    )
    if torch.cuda.is_available():
        out.append(
            Check(
                "nccl",
                "ok" if nccl else "warn",
                "available" if nccl else "missing (Windows and macOS builds have none)",
                "" if nccl else "--gpus N runs on gloo here: it works, with slower gradient exchange.",
            )
        )
    else:
        out.append(Check("nccl", "info", "not used without a CUDA GPU: several processes run on gloo"))
    if dist_.has_libuv(platform_name):
        out.append(Check("libuv", "ok", "torch's TCP store can use libuv"))
    else:
        out.append(
            Check(
                "libuv",
                "info",
                f"none on {platform_name}: difftrain's launcher sets USE_LIBUV=0 for torchrun's store",
                "If you start torchrun yourself, set USE_LIBUV=0 first.",
            )
        )
    out.append(Check("ddp buckets", "info", f"gradient buckets capped under 2^31 elements ({dist_.INT32_MAX:,})"))
    return out


def recipe_fit(cfg) -> Check:
    """The planner's peak for a config against this machine's free GPU memory (and available host RAM)."""
    import torch

    from ..planning.estimate import plan_memory

    plan = plan_memory(cfg)
    need, host = plan.free_needed, plan.host_total
    avail = host_ram_gib()[1]
    ram = f"; {host:.1f} GiB of host RAM" + (f", {avail:.1f} GiB available" if avail is not None else "")
    short_ram = avail is not None and host > avail
    ram_fix = " Free host RAM first (close programs), or use a recipe for a smaller tier." if short_ram else ""
    if not torch.cuda.is_available():
        return Check(
            "fits",
            "info",
            f"plan: {need:.1f} GiB of GPU memory at peak, {plan.card_total:.1f} GiB on a card that also drives a "
            f"display{ram} (no GPU here to compare with)",
            f"Run it on a card of at least {plan.card_total:.1f} GiB; `difftrain plan --vram NGiB` lists settings for a "
            "smaller one." + ram_fix,
        )
    free = torch.cuda.mem_get_info()[0] / 2**30
    ok = need <= free
    fix = "" if ok else f"`difftrain plan --vram {free:.0f}GiB` lists settings predicted to fit."
    return Check(
        "fits",
        "fail" if not ok else "warn" if short_ram else "ok",
        f"plan: {need:.1f} GiB of GPU memory at peak, {free:.1f} GiB free{ram}",
        (fix + ram_fix).strip(),
    )


def environment_lines() -> list[str]:
    env = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "USE_LIBUV", "WORLD_SIZE") if k in os.environ}
    return [f"{k}={v}" for k, v in env.items()]
