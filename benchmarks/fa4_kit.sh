#!/usr/bin/env bash
# Build the FlashAttention-4 kit that benchmarks/fa4_stage.sh installs on the GPU machine (issue 24, item 5):
# .fa4a/kit.part1 and .fa4b/kit.part2 (git-ignored), each under the 64 MiB a device call may carry beside .whl.
#   bash benchmarks/fa4_kit.sh            (downloads the pinned wheels from the package registry; ~3 min of xz)
# The kit: flash-attn-4 4.0.0b36 and what it needs that the GPU image lacks (nvidia-cutlass-dsl 4.8.1 with its
# CUDA-13 libraries, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext), for CPython 3.12 on x86-64. The CUDA-13
# library wheel is 92 MB: it travels unpacked, its two large .so files xz-compressed (x86 BCJ filter), with sha256
# sums of every file, and fa4_stage.sh rebuilds and checks the tree on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
W=${FA4_WORK:-/tmp/fa4kit}
rm -rf "$W"; mkdir -p "$W/dl" "$W/kit/wheels" "$W/kit/cu13" "$W/kit/big" "$W/cu13tree"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$W/dl" \
    "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" \
    "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi==0.1.15.post2" \
    "torch-c-dlpack-ext==0.1.5" "quack-kernels==0.6.5"
K=$W/kit
for f in "$W"/dl/*.whl; do
  case "$(basename "$f")" in nvidia_cutlass_dsl_libs_cu13-*) ;; *) cp "$f" "$K/wheels/" ;; esac
done
(cd "$W/cu13tree" && unzip -q "$W"/dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
IR=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
RT=nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
(cd "$W/cu13tree" && find . -type f | sort | sed 's|^\./||' | xargs sha256sum) > "$K/SHA256SUMS.cu13"
(cd "$K/wheels" && sha256sum ./*.whl | sed 's| \./| |') > "$K/SHA256SUMS.wheels"
xz --x86 --lzma2=preset=9e -T1 -c "$W/cu13tree/$IR" > "$K/big/ir.so.xz"
xz --x86 --lzma2=preset=9e -T1 -c "$W/cu13tree/$RT" > "$K/big/rt.so.xz"
cmp "$W/cu13tree/$IR" <(xz -dc "$K/big/ir.so.xz"); cmp "$W/cu13tree/$RT" <(xz -dc "$K/big/rt.so.xz")
printf '%s\n%s\n' "$IR" "$RT" > "$K/big/TARGETS"
(cd "$W/cu13tree" && rm -f "$IR" "$RT" && tar cf - --sort=name .) > "$K/cu13/tree.tar"
(cd "$K" && tar cf "$W/kit.tar" --sort=name --owner=0 --group=0 --mtime=@0 .)
S=$(stat -c %s "$W/kit.tar"); H=$(((S + 1) / 2))
rm -rf "$ROOT/.fa4a" "$ROOT/.fa4b"; mkdir -p "$ROOT/.fa4a" "$ROOT/.fa4b"
head -c $H "$W/kit.tar" > "$ROOT/.fa4a/kit.part1"; tail -c +$((H + 1)) "$W/kit.tar" > "$ROOT/.fa4b/kit.part2"
for d in .fa4a .fa4b; do
  { echo "kit.tar $(sha256sum < "$W/kit.tar" | cut -c1-64) $S"
    echo "kit.part1 $(sha256sum < "$ROOT/.fa4a/kit.part1" | cut -c1-64)"
    echo "kit.part2 $(sha256sum < "$ROOT/.fa4b/kit.part2" | cut -c1-64)"; } > "$ROOT/$d/MANIFEST"
done
du -sh "$ROOT/.fa4a" "$ROOT/.fa4b"
