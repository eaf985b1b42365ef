"""difftrain doctor on a CUDA GPU with the GPU kit installed: each engine's tiny operation runs for real."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_doctor_engine_checks_run_on_the_gpu():
    from difftrain.flows.doctor import checks

    rows = {r.name: r for r in checks()}
    assert rows["bitsandbytes"].status == "ok", rows["bitsandbytes"]
    assert rows["torchao"].status == "ok", rows["torchao"]  # an AdamW8bit step on CUDA
    assert rows["deepspeed"].status in ("ok", "info"), rows["deepspeed"]  # CPU Adam stepped, or its op compatible
    fp8 = rows["fp8"]
    assert fp8.status == ("ok" if torch.cuda.get_device_capability() >= (8, 9) else "info"), fp8
    assert rows["nccl"].status == "ok" and rows["gpu 0"].status == "ok"
