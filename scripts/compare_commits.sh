#!/usr/bin/env bash
# The kernel benchmark and a short 8B end-to-end run on two checkouts of lazyrag, alternating
# (before, after, before, after, ...) in one GPU run, so that a change that should not move
# speed can be shown not to: each row's median and spread per checkout land in $OUT/compare.md.
#
# Usage (CUDA machine, after the wheel install line of shared/tools/gpu-wheels.sh):
#   RUNS=3 STEPS="kernels e2e" bash scripts/compare_commits.sh BEFORE_DIR AFTER_DIR
# A checkout is run with its own package first on the path: PYTHONPATH=SITE_DIR, where SITE_DIR
# holds it installed (pip install --target), or the checkout itself for a layout that imports
# from its root. Set BEFORE_SITE / AFTER_SITE to choose; the default is the checkout.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
before=$(realpath "$1"); after=$(realpath "$2")
runs=${RUNS:-3}
work=$(mktemp -d /tmp/compare-XXXX)
E2E_ARGS=${E2E_ARGS:---models random:llama3-8b --requests 64 --docs 32 --skip-full --rounds 1 --rates= --sweep-docs=}

steps=" ${STEPS:-kernels e2e} "
want() { [[ $steps == *" $1 "* ]]; }

one() {  # name checkout site run
  local name=$1 tree=$2 site=$3 i=$4 dir="$work/$1-$4"
  local env=(env OUT="$dir" PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}")
  mkdir -p "$dir"
  if want kernels; then
    (cd "$tree" && "${env[@]}" timeout "${KERNEL_LIMIT:-90}" python3 scripts/bench_kernels.py --quick --ps64 \
      > "$dir/kernels.log" 2>&1)
    echo "$name $i kernels exit $?"
  fi
  if want e2e; then
    (cd "$tree" && "${env[@]}" timeout "${E2E_LIMIT:-120}" python3 scripts/bench_e2e.py $E2E_ARGS > "$dir/e2e.log" 2>&1)
    echo "$name $i e2e exit $?"
    rm -rf /tmp/lazyrag-e2e-*  # an 8B store is ~10 GB: the disk holds a few
  fi
}

deadline=$((SECONDS + ${DEADLINE:-100000}))  # start no run after this many seconds: the summary must still be written
for i in $(seq "$runs"); do
  [ $SECONDS -lt $deadline ] || break
  one before "$before" "${BEFORE_SITE:-$before}" "$i"
  [ $SECONDS -lt $deadline ] || break
  one after "$after" "${AFTER_SITE:-$after}" "$i"
done

python3 - "$work" "$OUT" <<'PY'
import json, re, statistics, sys, tarfile
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
with tarfile.open(out / "compare-logs.tar.gz", "w:gz") as tar:
    tar.add(work, arcname="compare")
rows = {}  # (row, tree) -> [values]
for d in sorted(work.iterdir()):
    tree = d.name.rsplit("-", 1)[0]
    md = d / "bench_kernels.md"
    if md.exists():
        for line in md.read_text().splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) > 2 and re.fullmatch(r"[\d.]+", cells[1]) and not cells[0].startswith("deferral"):
                rows.setdefault((f"kernel {cells[0]} (us)", tree), []).append(float(cells[1]))
    js = d / "bench_e2e.json"
    if js.exists():
        for res in json.loads(js.read_text())["results"]:
            for wl in ("closed", "uniform"):
                for r in res.get(wl, []):
                    rows.setdefault((f"e2e {wl} {r['mode']} req/s", tree), []).append(r["req_per_s"])
                    rows.setdefault((f"e2e {wl} {r['mode']} TTFT mean ms", tree), []).append(r["ttft_ms"]["mean"])
names = sorted({k[0] for k in rows})
lines = ["| row | before: median (min-max) | after: median (min-max) | after / before |", "|---|---|---|---|"]
for n in names:
    cell = {}
    for t in ("before", "after"):
        v = rows.get((n, t), [])
        cell[t] = (statistics.median(v), min(v), max(v), len(v)) if v else None
    fmt = lambda c: "n/a" if c is None else f"{c[0]:.1f} ({c[1]:.1f}-{c[2]:.1f}, {c[3]} runs)"
    ratio = f"{cell['after'][0] / cell['before'][0]:.3f}" if cell["before"] and cell["after"] else ""
    lines.append(f"| {n} | {fmt(cell['before'])} | {fmt(cell['after'])} | {ratio} |")
(out / "compare.md").write_text("\n".join(lines) + "\n")
(out / "compare.json").write_text(json.dumps({f"{k[0]} | {k[1]}": v for k, v in rows.items()}, indent=1))
print("\n".join(lines))
PY
