"""difftrain doctor: every line says what was found and, when it is not ok, what to do."""

from __future__ import annotations

import sys

from difftrain import doctor


def test_doctor_lists_the_machine_and_a_recipe_fit(cli):
    r = cli("doctor", "--recipe", "tiny-sdxl-lora")
    assert r.code == 0, r
    for needle in ("python", "torch", "diffusers", "gloo", "libuv", "fits", "plan:"):
        assert needle in r.err, needle
    found = {c.name: c for c in doctor.checks()}
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
