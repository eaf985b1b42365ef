"""difftrain doctor: every line says what was found and, when it is not ok, what to do."""

from __future__ import annotations

import sys

from difftrain.flows import doctor


def test_doctor_lists_the_machine_and_a_recipe_fit(cli):
    r = cli("doctor", "--recipe", "tiny-sdxl-lora")
    assert r.code == 0, r
    for needle in ("python", "torch", "diffusers", "gloo", "libuv", "fits", "plan:"):
        assert needle in r.err, needle
    found = {c.name: c for c in doctor.checks()}
    from difftrain import __version__

    assert found["difftrain"].found == __version__  # the version, as `difftrain --version` prints it
    if found["bitsandbytes"].status == "warn":  # not installed here: the line says how to get it
        assert found["bitsandbytes"].fix.startswith("pip install 'difftrain[bnb]'")


def test_windows_platform_lines_name_the_libuv_guard():
    lines = {c.name: c for c in doctor.distributed_checks(platform_name="win32")}
    assert lines["libuv"].status == "info" and "USE_LIBUV=0" in lines["libuv"].found + lines["libuv"].fix
    assert lines["gloo"].status == "ok"
    assert {c.name: c for c in doctor.distributed_checks(platform_name="linux")}["libuv"].status == "ok"


def test_a_library_that_does_not_import_gets_a_fix(monkeypatch):
    for mod in ("peft", "torchao", "torchao.optim"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    found = {c.name: c for c in doctor.checks()}
    assert found["peft"].status == "fail" and found["peft"].fix == "pip install peft"
    assert found["torchao"].status == "warn" and "difftrain[torchao]" in found["torchao"].fix


def test_a_failing_check_exits_1(cli, monkeypatch):
    monkeypatch.setattr(doctor, "checks", lambda: [doctor.Check("python", "fail", "2.7", "Use Python 3.10 or newer.")])
    r = cli("doctor")
    assert r.code == 1 and "Use Python 3.10" in r.err


# ----------------------------------------------------------------- the engines' tiny operations, faked on the CPU
def _fake_modules(monkeypatch, **modules):
    """Install fake modules: name -> dict of attributes."""
    import types

    for name, attrs in modules.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)


class _Adam:
    """An optimizer that steps like SGD (or raises, when ``boom``)."""

    boom: Exception | None = None

    def __init__(self, params, lr, **kw):
        self.params = list(params)
        self.lr = lr

    def step(self):
        if self.boom:
            raise self.boom
        for p in self.params:
            p.data -= self.lr * p.grad


def _fake_deepspeed(monkeypatch, prebuilt: bool, compatible: bool = True, boom=None):
    constructed = []

    class CPUAdam(_Adam):
        def __init__(self, *a, **kw):
            constructed.append(1)
            super().__init__(*a, **kw)

    CPUAdam.boom = boom

    class Builder:
        def is_compatible(self, verbose=False):
            return compatible

    _fake_modules(
        monkeypatch,
        deepspeed={"__version__": "0.99"},
        **{
            "deepspeed.git_version_info": {"installed_ops": {"cpu_adam": prebuilt}},
            "deepspeed.ops": {},
            "deepspeed.ops.adam": {"DeepSpeedCPUAdam": CPUAdam},
            "deepspeed.ops.op_builder": {"CPUAdamBuilder": Builder},
        },
    )
    return constructed


def test_deepspeed_prebuilt_cpu_adam_steps_or_fails_with_a_fix(monkeypatch):
    constructed = _fake_deepspeed(monkeypatch, prebuilt=True)
    c = doctor._deepspeed(cuda=True)
    assert c.status == "ok" and "DeepSpeedCPUAdam steps" in c.found and c.found.startswith("0.99") and constructed
    _fake_deepspeed(monkeypatch, prebuilt=True, boom=RuntimeError("undefined symbol: _ZN3c10\nmore"))
    c = doctor._deepspeed(cuda=True)
    assert c.status == "fail" and "undefined symbol" in c.found and "more" not in c.found
    assert "pip install --no-build-isolation --force-reinstall deepspeed" in c.fix and "ds_report" in c.fix


def test_deepspeed_op_not_prebuilt_is_never_jit_built_here(monkeypatch):
    constructed = _fake_deepspeed(monkeypatch, prebuilt=False, compatible=True)
    c = doctor._deepspeed(cuda=True)
    assert c.status == "info" and "built on its first use" in c.found and "DS_BUILD_CPU_ADAM=1" in c.fix
    assert not constructed  # building takes a minute or more: the doctor does not
    _fake_deepspeed(monkeypatch, prebuilt=False, compatible=False)
    c = doctor._deepspeed(cuda=False)
    assert c.status == "warn" and "cannot be built" in c.found and "ZeRO runs on CUDA GPUs only" in c.found
    assert "g++ and ninja" in c.fix


def test_deepspeed_that_breaks_on_import_of_its_ops(monkeypatch):
    _fake_modules(monkeypatch, deepspeed={"__version__": "0.99"})
    monkeypatch.setitem(sys.modules, "deepspeed.git_version_info", None)  # import raises ImportError
    c = doctor._deepspeed(cuda=True)
    assert c.status == "fail" and "deepspeed.git_version_info" in c.found and "ds_report" in c.fix
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    c = doctor._deepspeed(cuda=True)
    assert c.status == "warn" and c.found == "not installed" and "pip install" in c.fix


def test_torchao_steps_on_the_gpu_or_says_what_to_do(monkeypatch):
    class AdamW8bit(_Adam):
        pass

    _fake_modules(monkeypatch, torchao={"__version__": "0.98"}, **{"torchao.optim": {"AdamW8bit": AdamW8bit}})
    assert doctor._torchao(cuda=False).status == "info"  # no step without a GPU
    c = doctor._torchao(cuda=True, device="cpu")  # the GPU's step, run on the CPU here
    assert c.status == "ok" and "AdamW8bit steps" in c.found
    AdamW8bit.boom = RuntimeError("triton not found")
    c = doctor._torchao(cuda=True, device="cpu")
    assert c.status == "fail" and "triton not found" in c.found and "pip install -U torchao" in c.fix and "bnb" in c.fix


def test_xformers_attention_runs_or_says_what_to_do(monkeypatch):
    import torch

    calls = []

    def attention(q, k, v):
        calls.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ).transpose(1, 2)

    _fake_modules(
        monkeypatch, xformers={"__version__": "0.97"}, **{"xformers.ops": {"memory_efficient_attention": attention}}
    )
    assert doctor._xformers(cuda=False).status == "info" and not calls
    monkeypatch.setattr(torch, "float16", torch.float32)  # the CPU's SDPA stands in for the GPU kernel
    c = doctor._xformers(cuda=True, device="cpu")
    assert c.status == "ok" and calls and "memory_efficient_attention runs" in c.found
    sys.modules["xformers.ops"].memory_efficient_attention = lambda q, k, v: (_ for _ in ()).throw(
        NotImplementedError("No operator found for `memory_efficient_attention_forward`")
    )
    c = doctor._xformers(cuda=True, device="cpu")
    assert c.status == "warn" and "No operator found" in c.found and "uninstall it" in c.fix
    monkeypatch.setitem(sys.modules, "xformers", None)
    assert doctor._xformers(cuda=True).status == "info"


def test_flash_attention_4_says_whether_speed_auto_uses_it(monkeypatch):
    from difftrain.errors import BackendUnavailable
    from difftrain.speed import fa4

    c = doctor._flash_attention_4((8, 9))  # an RTX 4090: FA4 has no kernels for it
    assert c.status == "info" and "9.x and 10.x" in c.found and "8.9" in c.found
    assert "no CUDA GPU" in doctor._flash_attention_4(None).found
    monkeypatch.setattr(fa4, "installed", lambda: False)
    c = doctor._flash_attention_4((9, 0))
    assert c.status == "info" and c.found == "not installed" and "pip install flash-attn-4" in c.fix
    ran = []
    monkeypatch.setattr(fa4, "installed", lambda: True)
    monkeypatch.setattr(fa4, "check", ran.append)
    c = doctor._flash_attention_4((9, 0), device="cpu")
    assert c.status == "ok" and "speed.attention auto uses it" in c.found and ran

    def broken(device):
        raise BackendUnavailable("speed.attention fa4 does not run on this device: DSLRuntimeError: no sm_90a")

    monkeypatch.setattr(fa4, "check", broken)
    c = doctor._flash_attention_4((10, 0), device="cpu")
    assert c.status == "warn" and "no sm_90a" in c.found and "uninstall it" in c.fix


def test_fp8_reports_the_compute_capability():
    assert doctor._fp8((9, 0), device="cpu").status == "ok"
    c = doctor._fp8((8, 6), device="cpu")
    assert c.status == "info" and "8.6" in c.found and "8.9+" in c.found and "bf16" in c.found
    assert doctor._fp8(None).status == "info"
    c = doctor._fp8((9, 0), device="cuda:99" if not __import__("torch").cuda.is_available() else "cuda:999")
    assert c.status == "fail" and "float8 tensors fail" in c.found and "memory.weights bf16" in c.fix


def test_recipe_fit_compares_the_plan_with_free_memory(monkeypatch):
    import torch

    from difftrain.config.load import resolve

    cfg = resolve(recipe="tiny-sdxl-lora").config
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = doctor.recipe_fit(cfg)
    assert c.status == "info" and "no GPU here" in c.found and "difftrain plan --vram" in c.fix
    need = float(c.found.split("plan: ")[1].split(" GiB")[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(need * 0.5 * 2**30), 80 * 2**30))
    c = doctor.recipe_fit(cfg)
    assert c.status == "fail" and f"{need * 0.5:.1f} GiB free" in c.found and "difftrain plan --vram" in c.fix
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int((need + 1) * 2**30), 80 * 2**30))
    monkeypatch.setattr(doctor, "host_ram_gib", lambda: (64.0, 0.01))
    c = doctor.recipe_fit(cfg)
    assert c.status == "warn" and "0.0 GiB available" in c.found and "Free host RAM" in c.fix
    monkeypatch.setattr(doctor, "host_ram_gib", lambda: (64.0, 60.0))
    assert doctor.recipe_fit(cfg).status == "ok"


def test_host_ram_without_an_available_figure_shows_the_total(monkeypatch):
    """A kernel without MemAvailable in /proc/meminfo: the total alone, not a crash formatting None."""
    from difftrain.flows import doctor

    monkeypatch.setattr(doctor, "host_ram_gib", lambda: (31.2, None))
    line = next(c for c in doctor.checks() if c.name == "host ram")
    assert line.status == "ok" and line.found == "31.2 GiB"
