#!/usr/bin/env bash
# A lent-GPU session in three verbs (docs/bench.md, "A lent-GPU session").
# The device tool's machine is bare, has no network, keeps nothing between
# calls once idle for 30 s, and sends back at most 8 files from $OUT; this
# script takes care of each of those so a session spends its device time on
# measuring:
#
#   bench/device.sh fetch            here: the wheels the GPU image lacks
#                                    (WHEELS, below) into .whl/, which git
#                                    ignores
#   bench/device.sh run STAGE[:S]... there, as one device call: install the
#                                    carried wheels, restore the autotune
#                                    cache (.device/ when carried, else the
#                                    newest bench/results/autotune-*.json), run the
#                                    run_h100.sh stages in order, each for at
#                                    most S seconds when given, and pack
#                                    what they wrote into $OUT/results.tgz
#   bench/device.sh keep FILES_AT    here: unpack a call's results into
#                                    bench/results/ and its autotune cache
#                                    into .device/ for the next call's carry
#
# `run` stops each stage in time for the packing: the call's whole budget is
# $DEVICE_BUDGET seconds (default 570, inside the tool's 600-second limit).
# A stage gets the seconds left of it, or its own S if fewer, and the bench
# inside it learns them ($NAPKIN_BENCH_SECONDS, 15 s less for writing its
# files), so its autotuning shares out that time rather than a whole
# command's: `main:270 variants` gives main 270 s and variants the rest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# napkin's dependencies (pyproject.toml) that the GPU image lacks (its package
# list: the device tool's KINDS.md), at the versions CI's install resolves
# today; lark's strict mode needs interegular (without it every diagram fails
# to parse).  torch, triton, numpy and jinja2 are on the image; graphviz only
# draws pictures.  tests/test_bench_scripts.py keeps this list and pyproject's together.
WHEELS=("lark==1.3.1" "interegular==0.3.3")

fetch() {
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
  ls .whl
}

run() {
  local start=$SECONDS budget="${DEVICE_BUDGET:-570}" out="${OUT:?run is for the device tool, whose \$OUT comes back}"
  export PYTHONUNBUFFERED=1 PYTHON=python3
  local wheels="${DEVICE_WHEELS:-.whl}" stages="${DEVICE_STAGES:-bench/run_h100.sh}"  # the tests' stand-in
  if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$wheels"/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
  else
    export PYTHONPATH="$PWD"
  fi
  local work="$out/results"
  mkdir -p "$work/autotune-cache"
  # the tuned configs so far: a carried .device/ (this session's earlier
  # call), else the newest committed record, so tunings go on across
  # sessions (the cache keys hold the device: an H100 ignores H200 entries)
  local tuned=.device/autotune.json schema
  # ... unless the carried one is of another schema than this napkin's (an
  # older napkin's keys): its first write would set it aside and retune all
  schema=$(sed -n 's/^SCHEMA = "\([^"]*\)".*/\1/p' napkin/tunecache.py 2>/dev/null)
  if [[ ! -f $tuned ]] || { [[ -n $schema ]] && ! grep -q "\"schema\": \"$schema\"" "$tuned"; }; then
    tuned=$(compgen -G "bench/results/autotune-*.json" | sort | tail -n 1)
  fi
  [[ -n $tuned && -f $tuned ]] && cp "$tuned" "$work/autotune-cache/autotune.json"
  export NAPKIN_BENCH_OUT="$work" NAPKIN_CACHE="$work/autotune-cache"
  local status=0 spec stage cap left
  for spec in "$@"; do
    stage=${spec%%:*} cap=
    [[ $spec == *:* ]] && cap=${spec#*:}
    if [[ -n $cap && ! $cap =~ ^[0-9]+$ ]]; then
      echo "device.sh: '$spec': a stage's seconds are a whole number (main:270)" | tee -a "$work/stages.log"
      status=2
      continue
    fi
    left=$((budget - (SECONDS - start) - 20))
    [[ -n $cap ]] && ((cap < left)) && left=$cap
    if ((left < 30)); then
      echo "device.sh: no time left for stage $stage" | tee -a "$work/stages.log"
      status=1
      continue
    fi
    echo "== $stage (up to ${left}s) $(date -u +%FT%TZ)" | tee -a "$work/stages.log"
    NAPKIN_BENCH_SECONDS=$((left - 15)) timeout "$left" "$stages" "$stage" 2>&1 | tee "$work/$stage.log"
    local rc=${PIPESTATUS[0]}
    echo "== $stage rc $rc after $((SECONDS - start))s" | tee -a "$work/stages.log"
    ((rc == 0)) || status=$rc
  done
  # one file back whatever the stages wrote (the tool returns at most 8)
  tar czf "$out/results.tgz" -C "$out" results && rm -rf "$work"
  exit "$status"
}

merge_cache() {
  # NEW's entries over INTO's (a call's newer tuning wins a shared key);
  # INTO of another schema, or unreadable, is replaced by NEW
  python3 - "$1" "$2" <<'EOF'
import json, os, sys
new_path, into_path = sys.argv[1], sys.argv[2]
new = json.load(open(new_path))
try:
    old = json.load(open(into_path))
    if old.get("schema") != new.get("schema") or not isinstance(old.get("entries"), dict):
        old = {"entries": {}}
except (OSError, ValueError):
    old = {"entries": {}}
entries = dict(sorted({**old["entries"], **new.get("entries", {})}.items()))
with open(into_path + ".tmp", "w") as f:
    f.write(json.dumps({**new, "entries": entries}, indent=1) + "\n")
os.replace(into_path + ".tmp", into_path)
EOF
}

keep() {
  local from="${1:?usage: bench/device.sh keep FILES_AT}" tmp day
  day=$(date -u +%F)   # once: the cache and the logs file under the same day
  tmp=$(mktemp -d)
  tar xzf "$from/results.tgz" -C "$tmp" || exit 1
  mkdir -p .device bench/results
  if [[ -f "$tmp/results/autotune-cache/autotune.json" ]]; then
    # merged into what is there, not copied over it: a call that started
    # without the last one's cache (its carry forgot .device/) came back
    # without that call's tunings (2026-11-28: call 2 dropped call 1's six)
    merge_cache "$tmp/results/autotune-cache/autotune.json" .device/autotune.json || exit 1
    merge_cache "$tmp/results/autotune-cache/autotune.json" "bench/results/autotune-$day.json" || exit 1
    chmod 644 "bench/results/autotune-$day.json"  # readable whatever the device's umask
  fi
  rm -rf "$tmp/results/autotune-cache"
  # Records where bench/results/README.md says: a run's JSON and markdown pair
  # takes the next free <device>-<date>[-N] (the harness's own numbering, so
  # the pairs of two calls on one day read in order); logs go under logs/ as
  # <date>-call<K>-<stage>.log, K this day's next call.
  local f name stem base n call=1
  mkdir -p bench/results/logs
  while compgen -G "bench/results/logs/$day-call$call-*" >/dev/null; do call=$((call + 1)); done
  for f in "$tmp"/results/*.log; do
    [[ -e $f ]] || continue
    name="$day-call$call-$(basename "$f")"
    cp "$f" "bench/results/logs/$name" && echo "bench/results/logs/$name"
  done
  # the ncu stage's files (its CSVs, launch options and bench/dram_bytes.py's
  # comparisons) under ncu/, as named, a taken name with the time of day in
  # front: JSON that is no bench record stays out of the pairs below
  mkdir -p bench/results/ncu
  for f in "$tmp"/results/ncu-* "$tmp"/results/dram-bytes-*; do
    [[ -f $f ]] || continue
    name=$(basename "$f")
    [[ -e bench/results/ncu/$name ]] && name="$(date -u +%H%M%S)-$name"
    cp "$f" "bench/results/ncu/$name" && echo "bench/results/ncu/$name" && rm -f "$f"
  done
  rmdir bench/results/ncu 2>/dev/null
  # a call's own pairs in their order: <device>-<date> before its -2, -3 ...
  for stem in $(for f in "$tmp"/results/*.json; do
                  [[ -e $f ]] || continue
                  stem=$(basename "$f" .json)
                  [[ $stem =~ -[0-9]{4}-[0-9]{2}-[0-9]{2}-([0-9]+)$ ]] && n=${BASH_REMATCH[1]} || n=1
                  echo "$n $stem"
                done | sort -n | cut -d' ' -f2); do
    base=$stem
    [[ $stem =~ ^(.*-[0-9]{4}-[0-9]{2}-[0-9]{2})-[0-9]+$ ]] && base=${BASH_REMATCH[1]}
    name=$base n=1
    while [[ -e bench/results/$name.json || -e bench/results/$name.md ]]; do
      n=$((n + 1)) name=$base-$n
    done
    for f in "$tmp/results/$stem".json "$tmp/results/$stem".md; do
      [[ -e $f ]] && cp "$f" "bench/results/$name.${f##*.}" && echo "bench/results/$name.${f##*.}"
    done
    rm -f "$tmp/results/$stem".json "$tmp/results/$stem".md
  done
  # anything else (decode's tables): as named, a taken name gets
  # the time of day in front
  for f in "$tmp"/results/*; do
    [[ -f $f && $f != *.log ]] || continue
    name=$(basename "$f")
    [[ -e bench/results/$name ]] && name="$(date -u +%H%M%S)-$name"
    cp "$f" "bench/results/$name" && echo "bench/results/$name"
  done
  rm -rf "$tmp"
}

verb="${1:-}"
shift || true
case "$verb" in
  fetch) fetch ;;
  run) (($#)) || { echo "usage: $0 run STAGE[:SECONDS]..." >&2; exit 2; }; run "$@" ;;
  keep) keep "$@" ;;
  *) echo "usage: $0 fetch | run STAGE[:SECONDS]... | keep FILES_AT" >&2; exit 2 ;;
esac
