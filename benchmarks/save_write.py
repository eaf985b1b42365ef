"""Writing a .safetensors file: difftrain's one-tensor-at-a-time writer (utils.stream_save_safetensors) against the
copy it made of each tensor's bytes until 2026-12-08 (``.tobytes()`` before the write) and safetensors' own
``save_file`` (which serialises the whole dict in host memory first). Seconds per file and the growth of the peak RSS,
each way in a process of its own (ru_maxrss only grows).

    python3 benchmarks/save_write.py --gib 0.5 --tensors 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
from pathlib import Path
way, n, rows, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
sd = {f"w{i}": torch.randn(rows, 8192, dtype=torch.bfloat16) for i in range(n)}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def copying(path, tensors):  # the writer as it was: each tensor's bytes copied into a bytes object, then written
    import struct
    from difftrain.utils import _ST_DTYPES, atomic_file
    names, header, offset = sorted(tensors), {}, 0
    for k in names:
        t = tensors[k]
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k in names:
            f.write(tensors[k].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


times = []
for _ in range(3):
    t0 = time.perf_counter()
    if way == "difftrain":
        from difftrain.utils import stream_save_safetensors
        stream_save_safetensors(out, sd)
    elif way == "copying":
        copying(out, sd)
    else:
        from safetensors.torch import save_file
        save_file(sd, str(out))
    times.append(time.perf_counter() - t0)
print(json.dumps({"s": min(times), "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5, help="the file's size")
    ap.add_argument("--tensors", type=int, default=4)
    args = ap.parse_args()
    rows = max(1, int(args.gib * 2**30 / args.tensors / (8192 * 2)))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in ("difftrain", "copying", "save_file"):
            out = Path(tmp) / f"{way}.safetensors"
            cmd = [sys.executable, "-c", CHILD, way, str(args.tensors), str(rows), str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[way] = json.loads(r.stdout.strip().splitlines()[-1])
            out.unlink()
    size = args.tensors * rows * 8192 * 2 / 2**20
    print(json.dumps({"file_mib": size, "tensor_mib": size / args.tensors, **results}))
    print(f"| writer | s per {size:.0f} MiB file (best of 3) | peak RSS growth MiB |")
    print("|---|---|---|")
    for way, r in results.items():
        print(f"| {way} | {r['s']:.3f} | {r['rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
