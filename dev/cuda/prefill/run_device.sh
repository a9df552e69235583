#!/bin/bash
# One device call for the prefill kernel (run from the repository root):
# the benchmark for each consumer loop named in VARIANTS with torch's cuDNN
# SDPA after the first (an entry NAME+ORDER runs NAME with
# MLA_PREFILL_ORDER=ORDER, e.g. overlap232-tma+rr), the SM clock and power
# sampled every 200 ms meanwhile (clocks.csv), then for each entry of
# TEST_DEFAULTS the GPU test (its "default" pass runs that variant through
# MLA_PREFILL_DEFAULT; "-" = the built-in default; NAME+ORDER as above) and,
# with MEMCHECK=1, memcheck of the test's small mode with the same default
# (MEMCHECK_DEFAULTS overrides the list; MEMCHECK_DEFAULT, one entry, is the
# older spelling). Uses a build in $BUILD (default build-g; built here when
# its binaries are missing or do not start). Logs in $OUT, written as they
# come (a timeout keeps the rest).
#   VARIANTS="plain overlap232-tma overlap232-tma+rr" TEST_DEFAULTS="-" \
#     MEMCHECK=1 dev/cuda/prefill/run_device.sh
set -u
OUT=${OUT:-out}
BUILD=${BUILD:-build-g}
VARIANTS=${VARIANTS:-"plain overlap232-tma overlap232-tma+rr"}
TEST_DEFAULTS=${TEST_DEFAULTS:-"-"}
MEMCHECK_DEFAULTS=${MEMCHECK_DEFAULTS:-${MEMCHECK_DEFAULT:-$TEST_DEFAULTS}}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv >"$OUT/env.txt" 2>&1
date -u >>"$OUT/env.txt"
if ! "$BUILD/tests/test_cuda_ragged" small >"$OUT/small.log" 2>&1 || ! [ -x "$BUILD/bench" ]; then
  echo "building in $BUILD" | tee -a "$OUT/env.txt"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j32 --target test_cuda_ragged >>"$OUT/build.log" 2>&1 &&
    make -C dev/cuda/prefill BUILD="../../../$BUILD" >>"$OUT/build.log" 2>&1 &&
    cp dev/cuda/prefill/bench "$BUILD/bench" || { tail -30 "$OUT/build.log"; exit 1; }
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 200 >"$OUT/clocks.csv" 2>&1 &
smi=$!
{
  first=1
  for v in $VARIANTS; do
    if [ "${v#*+}" != "$v" ]; then
      MLA_PREFILL_ORDER=${v#*+} MLA_PREFILL_VARIANT=${v%%+*} "$BUILD/bench"
    else
      MLA_PREFILL_VARIANT=$v "$BUILD/bench"
    fi
    [ $first = 1 ] && python3 dev/cuda/prefill/torch_sdpa.py cudnn
    first=0
  done
} 2>&1 | tee "$OUT/bench.log"
kill "$smi" 2>/dev/null
# SM clock while the GPU drew more than 300 W (the kernels, not the set-up)
awk -F', ' '$3+0 > 300 {n++; s += $2; if (min == "" || $2+0 < min) min = $2+0; if ($2+0 > max) max = $2+0}
  END {if (n) printf "SM clock under load: mean %.0f MHz, min %d, max %d (%d samples)\n", s/n, min, max, n}' \
  "$OUT/clocks.csv" | tee -a "$OUT/env.txt"
for d in $TEST_DEFAULTS; do
  unset MLA_PREFILL_ORDER
  if [ "${d#*+}" != "$d" ]; then export MLA_PREFILL_ORDER=${d#*+}; fi
  if [ "${d%%+*}" = "-" ]; then unset MLA_PREFILL_DEFAULT; else export MLA_PREFILL_DEFAULT=${d%%+*}; fi
  "$BUILD/tests/test_cuda_ragged" >"$OUT/test-$d.log" 2>&1
  echo "test_cuda_ragged (default pass = $d) rc=$?: $(tail -1 "$OUT/test-$d.log")"
  grep -i "fail" "$OUT/test-$d.log" | grep -v " 0 failed" | head -10
  if [ "${MEMCHECK:-0}" = 1 ] && [[ " $MEMCHECK_DEFAULTS " == *" $d "* ]]; then
    compute-sanitizer --tool memcheck "$BUILD/tests/test_cuda_ragged" small >"$OUT/memcheck-$d.log" 2>&1
    echo "memcheck (default pass = $d) rc=$?: $(tail -2 "$OUT/memcheck-$d.log" | tr '\n' ' ')"
  fi
done
unset MLA_PREFILL_DEFAULT MLA_PREFILL_ORDER
