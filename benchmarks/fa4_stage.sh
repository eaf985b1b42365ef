#!/usr/bin/env bash
# Stage and install the FlashAttention-4 kit (flash-attn-4 4.0.0b36 + nvidia-cutlass-dsl 4.8.1 cu13,
# quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext) on the GPU machine, in two device calls.
# The kit is one tar split in two halves, each under the 64 MiB carry limit next to .whl:
#   .fa4a/kit.part1 + MANIFEST   and   .fa4b/kit.part2 + MANIFEST   (both git-ignored)
# Run from anywhere, every call: it copies whichever half is present into .fa4stage/ (ignored, so it
# stays on a warm machine between calls); once both halves are staged it reassembles the tar, checks
# sha256 of the tar, of every wheel and of every file of the cu13 flavour, and installs into SITE.
#   bash benchmarks/fa4_stage.sh [SITE]     (SITE defaults to $FA4_SITE or /tmp/fa4site)
# Then: export PYTHONPATH=SITE:SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
# (--target installs skip nvidia_cutlass_dsl_packages.pth, which adds dsl_packages to sys.path.)
# FA4_PIP_EXTRA adds pip options (a CPU test here: --python-version 3.12 --only-binary=:all: ...).
# Exit status: 0 installed, 3 still missing a half (nothing wrong), 1 error.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
SITE=${1:-${FA4_SITE:-/tmp/fa4site}}
ST=$PWD/.fa4stage
PY=${PYTHON:-python3}
sha() { sha256sum "$1" | cut -c1-64; }
fail() { echo "FA4 kit: ERROR: $*"; exit 1; }
mkdir -p "$ST" || fail "cannot create $ST"

# 1. stage whichever halves were carried (a new kit's MANIFEST drops the older staged halves)
for d in .fa4a .fa4b; do
  [ -f "$d/MANIFEST" ] || continue
  if [ -f "$ST/MANIFEST" ] && ! cmp -s "$d/MANIFEST" "$ST/MANIFEST"; then
    echo "FA4 kit: $d holds a different kit than $ST; dropping the staged halves"
    rm -f "$ST"/kit.part* "$ST/MANIFEST"
  fi
  cp "$d/MANIFEST" "$ST/MANIFEST.tmp" && mv "$ST/MANIFEST.tmp" "$ST/MANIFEST"
  for f in "$d"/kit.part*; do
    [ -f "$f" ] || continue
    n=$(basename "$f")
    want=$(awk -v n="$n" '$1 == n {print $2}' "$ST/MANIFEST")
    [ -f "$ST/$n" ] && [ "$(sha "$ST/$n")" = "$want" ] && continue
    [ "$(sha "$f")" = "$want" ] || fail "$f does not match its MANIFEST (truncated copy?)"
    cp "$f" "$ST/$n.tmp" && mv "$ST/$n.tmp" "$ST/$n" || fail "cannot copy $f"
  done
done
[ -f "$ST/MANIFEST" ] || { echo "FA4 kit: nothing staged (carry .fa4a or .fa4b)"; exit 3; }
kit=$(awk '$1 == "kit.tar" {print $2}' "$ST/MANIFEST")
size=$(awk '$1 == "kit.tar" {print $3}' "$ST/MANIFEST")

# 2. already installed from this kit?
if [ -f "$SITE/.fa4kit" ] && [ "$(cat "$SITE/.fa4kit")" = "$kit" ]; then
  echo "FA4 kit: installed in $SITE (kit ${kit:0:12}); PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
  exit 0
fi
have=""; missing=""
for n in kit.part1 kit.part2; do
  want=$(awk -v n="$n" '$1 == n {print $2}' "$ST/MANIFEST")
  if [ -f "$ST/$n" ] && [ "$(sha "$ST/$n")" = "$want" ]; then have="$have $n"; else missing="$missing $n"; fi
done
if [ -n "$missing" ]; then
  echo "FA4 kit: staged [${have# }], still missing [${missing# }] (carry .fa4a for part1, .fa4b for part2)"
  exit 3
fi

# 3. reassemble, verify, install into a fresh folder, then swap it in
W="$ST/work"; NEW="$SITE.new"
rm -rf "$W" "$NEW"; mkdir -p "$W/x" || fail "cannot create $W"
cat "$ST/kit.part1" "$ST/kit.part2" > "$W/kit.tar" || fail "cannot write $W/kit.tar"
[ "$(stat -c %s "$W/kit.tar")" = "$size" ] && [ "$(sha "$W/kit.tar")" = "$kit" ] || fail "reassembled kit.tar fails sha256"
tar xf "$W/kit.tar" -C "$W/x" || fail "cannot unpack kit.tar"
(cd "$W/x/wheels" && sha256sum --quiet -c ../SHA256SUMS.wheels) || fail "wheel sha256 mismatch"
# shellcheck disable=SC2086  # FA4_PIP_EXTRA is a list of options
PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --disable-pip-version-check ${FA4_PIP_EXTRA:-} --target "$NEW" "$W"/x/wheels/*.whl || fail "pip install failed"
tar xf "$W/x/cu13/tree.tar" -C "$NEW" || fail "cannot unpack the cu13 tree"
"$PY" - "$W/x/big" "$NEW" <<'EOF' || fail "cannot decompress the cu13 libraries"
import lzma, os, shutil, sys
big, new = sys.argv[1:]
targets = open(os.path.join(big, "TARGETS")).read().split()
for src, dst in zip(("ir.so.xz", "rt.so.xz"), targets):
    with lzma.open(os.path.join(big, src)) as fi, open(os.path.join(new, dst), "wb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 24)
    os.chmod(os.path.join(new, dst), 0o755)
EOF
(cd "$NEW" && sha256sum --quiet -c "$W/x/SHA256SUMS.cu13") || fail "cu13 file sha256 mismatch"
echo "$kit" > "$NEW/.fa4kit"
rm -rf "$SITE" && mv "$NEW" "$SITE" || fail "cannot move $NEW to $SITE"
rm -rf "$W"
echo "FA4 kit: installed in $SITE now (kit ${kit:0:12}, sha256 verified); PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
exit 0
