#!/usr/bin/env bash
# Run on the lent GPU machine from the repo root (with .whl carried):
#   bash benchmarks/device.sh "<command>"
# Installs the wheel kit (diffusers, bitsandbytes, torchao, deepspeed, pydantic, pytest)
# that ../shared/tools/device-wheels.sh builds, puts src/ on the path, then runs the command.
# pydantic 2.14 there also needs typing_inspection and typing_extensions>=4.16 in .whl:
#   pip download --no-deps -d .whl "typing_inspection==0.4.5" "typing_extensions==4.16.0"
# pytest-timeout reads pyproject.toml's per-test timeout there too (without it pytest warns of an unknown option):
#   pip download --no-deps -d .whl pytest-timeout
# and the GPU video validation test writes an mp4, which needs PyAV (35 MB, still inside the 64 MiB carry):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl av
set -eo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 DIFFTRAIN_PROGRESS=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, diffusers, transformers, peft, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__)"
set +e  # every command of the run reports, even after one fails
eval "$1"
