#!/usr/bin/env bash
# The shipped (speed auto) long-run seconds per step of recipes that `recipes list` shows, several per device call:
#   bash benchmarks/device.sh 'bash benchmarks/long_runs.sh $OUT 560 cogvideox-5b-lora-24gb:480x720 sdxl-full:1024x1024'
# Each RECIPE:HxW runs `difftrain bench speed --no-baseline --planned-steps 2000 --step-times` (uncapped, one shape)
# in its own work folder under /tmp/long (a random model of the recipe's architecture), WARMUP then STEPS steps
# (env, default 4 + 6), while the call's budget (seconds, 2nd argument) allows another; its bench_speed.json goes to
# OUT/<recipe>.json and a line of the table printed last. Each work folder is removed after its run unless KEEP=1.
set -u
out=$1; budget=$2; shift 2
start=$(date +%s)
warm=${WARMUP:-4}; steps=${STEPS:-6}
mkdir -p "$out"
for item in "$@"; do
    recipe=${item%%:*}; size=${item#*:}
    left=$(( budget - ($(date +%s) - start) ))
    if (( left < 60 )); then echo "skipped $recipe: ${left}s of the budget left" | tee -a "$out/table.txt"; continue; fi
    work=/tmp/long/$recipe
    t0=$(date +%s)
    timeout "$left" python3 -m difftrain bench speed --recipe "$recipe" --size "$size" --no-baseline \
        --planned-steps 2000 --step-times --steps "$steps" --warmup "$warm" --work "$work" > "$out/$recipe.log" 2>&1
    rc=$?
    [ -f "$work/bench_speed.json" ] && cp "$work/bench_speed.json" "$out/$recipe.json"
    [ "${KEEP:-0}" = 1 ] || rm -rf "$work"  # a 5B model's random files and cache: four filled a 64 GiB disk
    python3 - "$recipe" "$size" "$rc" "$(( $(date +%s) - t0 ))" "$work/bench_speed.json" >> "$out/table.txt" <<'PY'
import json, os, sys
recipe, size, rc, secs, path = sys.argv[1:]
if rc != "0" or not os.path.exists(path):
    print(f"{recipe} {size}: rc {rc} after {secs} s (see {recipe}.log)")
    sys.exit()
d = json.load(open(path)); r = d["rows"][-1]
st = sorted(r["step_s"][d["warmup"]:]) if r.get("step_s") else []
med = st[len(st) // 2] if st else None
print(f"{recipe} {size}: s/step {r['s_per_step']} (median {med}) first {r.get('first_step_s')} warm-up extra "
      f"{r.get('warmup_overhead_s')} alloc/res {r.get('peak_alloc_gib')}/{r.get('peak_reserved_gib')} "
      f"MFU {r.get('mfu')} | {r.get('speed')} | call {secs} s | {d['device']}")
PY
done
cat "$out/table.txt"
