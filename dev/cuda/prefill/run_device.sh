#!/bin/bash
# One device call for the prefill kernel (run from the repository root):
# the benchmark for each consumer loop named in VARIANTS with torch's cuDNN
# SDPA after the first, the GPU test once per entry of TEST_DEFAULTS (the
# variant its "default" pass runs, through MLA_PREFILL_DEFAULT; "-" = the
# built-in default), and with MEMCHECK=1 memcheck of the test's small mode
# (default pass = MEMCHECK_DEFAULT). Uses a build in $BUILD (default build-g;
# built here when its binaries are missing or do not start). Logs in $OUT.
#   VARIANTS="plain overlap" TEST_DEFAULTS="- overlap" MEMCHECK=1 \
#     dev/cuda/prefill/run_device.sh
set -u
OUT=${OUT:-out}
BUILD=${BUILD:-build-g}
VARIANTS=${VARIANTS:-"plain overlap pingpong"}
TEST_DEFAULTS=${TEST_DEFAULTS:-"-"}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv >"$OUT/env.txt" 2>&1
date -u >>"$OUT/env.txt"
if ! "$BUILD/tests/test_cuda_ragged" small >"$OUT/small.log" 2>&1 || ! [ -x "$BUILD/bench" ]; then
  echo "building in $BUILD" | tee -a "$OUT/env.txt"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j32 --target test_cuda_ragged >>"$OUT/build.log" 2>&1 &&
    make -C dev/cuda/prefill BUILD="../../../$BUILD" >>"$OUT/build.log" 2>&1 &&
    cp dev/cuda/prefill/bench "$BUILD/bench" || { tail -30 "$OUT/build.log"; exit 1; }
fi
export PYTHONUNBUFFERED=1
{
  first=1
  for v in $VARIANTS; do
    MLA_PREFILL_VARIANT=$v "$BUILD/bench"
    [ $first = 1 ] && python3 dev/cuda/prefill/torch_sdpa.py cudnn
    first=0
  done
} 2>&1 | tee "$OUT/bench.log"
for d in $TEST_DEFAULTS; do
  if [ "$d" = "-" ]; then unset MLA_PREFILL_DEFAULT; else export MLA_PREFILL_DEFAULT=$d; fi
  "$BUILD/tests/test_cuda_ragged" >"$OUT/test-$d.log" 2>&1
  echo "test_cuda_ragged (default pass = $d) rc=$?: $(tail -1 "$OUT/test-$d.log")"
  grep -i "fail" "$OUT/test-$d.log" | grep -v " 0 failed" | head -10
done
if [ "${MEMCHECK:-0}" = 1 ]; then
  MLA_PREFILL_DEFAULT=${MEMCHECK_DEFAULT:-plain} compute-sanitizer --tool memcheck \
    "$BUILD/tests/test_cuda_ragged" small >"$OUT/memcheck.log" 2>&1
  echo "memcheck (default pass = ${MEMCHECK_DEFAULT:-plain}) rc=$?: $(tail -2 "$OUT/memcheck.log" | tr '\n' ' ')"
fi
