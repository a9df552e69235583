#!/usr/bin/env bash
# GPU check for libmla's CUDA decode path: one call on the device machine.
#
#   scripts/gpu-check.sh [stage]
#
# stages: all (default: env build unit check sanitize bench torch), or a comma-separated list of
#   env       nvidia-smi, nvcc, SM clock
#   build     dev/cuda harness (nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -lineinfo -Xptxas -v),
#             ptxas report and HGMMA/HMMA counts from cuobjdump --dump-sass
#   unit      descriptor / TMA unit tests (dev/cuda/desc_test.cu) and the fp8 register-operand layout check
#             (dev/cuda/fp8_rs.cu check: raw e4m3 rows as wgmma A fragments against float64)
#   check     correctness grid for every version (H 1,3,16,64,128 x s_q 1,2,4 x pages 1,4,16,64,128, varlen, zero lengths)
#   sanitize  compute-sanitizer memcheck (every version) and racecheck (wgmma versions) on a tiny grid
#   bench     b=128, s_k 4096/8192/16384, H 16/128, s_q 1/2, page 64; b=64 s_k=4096 H=16 s_q=1;
#             device copy bandwidth; clocks
#   noload    DECODE_NOLOAD=1 timing diagnostic (no K refills: the compute pipeline alone; wrong results), s_q=1, s_k 8192
#   torch     bench/baseline_torch_decode.py (same shapes), torch bf16 matmul rate, torch copy rate,
#             and dev/cuda/prefill/torch_sdpa.py (SDPA backends on the prefill shapes)
#   lib       the library's CUDA build (cmake -DMLA_CUDA=ON) and its ctest suite
#   libgpu    (not in all) only the library's GPU tests (test_cuda_* and test_backend_graph, or LIBGPU_TESTS="a b";
#             quicker than lib), the Python binding's GPU tests (pytest, torch) and `mla bench --device cuda`
#             (the library's decode path, CUDA events, L2 flushed), and bench/prefill_vs_torch.py (the ragged
#             prefill against torch SDPA, interleaved call by call; PREFILL_VS_TORCH_ARGS adds options)
#   dcp       (not in all) decode context parallel over NCCL: nvidia-smi topo -m, the library's CUDA build
#             (NCCL found through MLA_NCCL_ROOT or torch's nvidia-nccl pip package), tests/test_cuda_dcp_nccl
#             (2 GPUs, one thread per rank) and `mla bench --dcp 2` (b=64 s_k=65536 H=128 bf16 page 64,
#             1 GPU vs 2; DCP_BENCH_ARGS adds options, DCP_TIMEOUT bounds each run, default 300 s)
#   libsan    (not in all) compute-sanitizer memcheck (must be clean) and racecheck (reported) over the
#             library's GPU tests in their small modes
#   ncu       (not in all) Nsight Compute sections for one launch per version (NCU_VERSIONS, NCU_HS="128 16")
#   full      all + lib
# Environment: PREBUILT=DIR (libgpu, libsan: no cmake; run the binaries of a CUDA build made elsewhere and
#   carried, DIR holding mla, libmla.so* and tests/test_*, as scripts/pack-prebuilt.sh packs them; the tests run one
#   by one instead of through ctest),
#   LIBBENCH_ARGS (more options for libgpu's `mla bench --device cuda`), VERSIONS (default 1,...,10), OUT (log folder; the device tool sets it), QUICK=1 (bench s_k 8192 only),
#   SKIP_BUILD=1 (use a dev/cuda/build carried from a machine with nvcc 13: no make; its ptxas reports are still listed),
#   CHECK_VERSIONS, SANITIZE_VERSIONS (default VERSIONS: the versions the check / sanitize stages run),
#   SANITIZE_TOOLS (default "memcheck racecheck").
# Logs land in $OUT (env.txt build.txt check.txt (unit + check) sanitize.txt bench.txt noload.txt torch.txt lib.txt summary.txt);
# a short table is printed last.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
STAGE=${1:-all}
VERSIONS=${VERSIONS:-1,2,3,4,5,6,7,8,9,10}
SKIP_BUILD=${SKIP_BUILD:-0}
CHECK_VERSIONS=${CHECK_VERSIONS:-$VERSIONS}
SANITIZE_VERSIONS=${SANITIZE_VERSIONS:-$VERSIONS}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-memcheck racecheck}
QUICK=${QUICK:-0}
H=$ROOT/dev/cuda/build/decode_harness
JOBS=$(nproc 2>/dev/null || echo 4)
PREBUILT=${PREBUILT:-}
LIB=${PREBUILT:-$ROOT/build-gpu}
[ -n "$PREBUILT" ] && LIB=$(cd "$PREBUILT" && pwd)
export PATH=$PATH:/usr/local/cuda/bin
status=0

want() {  # want STAGE: is this stage selected?
  case "$STAGE" in
    all) [ "$1" != lib ] && [ "$1" != ncu ] && [ "$1" != libgpu ] && [ "$1" != dcp ] ;;
    full) [ "$1" != ncu ] && [ "$1" != libgpu ] && [ "$1" != dcp ] ;;
    *) [[ ",$STAGE," == *",$1,"* ]] ;;
  esac
}

if want env; then
  {
    date -u
    nvidia-smi
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv
    nvcc --version
    git -C "$ROOT" rev-parse --short HEAD 2>/dev/null
  } > "$OUT/env.txt" 2>&1
fi

if want build; then
  {
    if [ "$SKIP_BUILD" = 1 ] && [ -x "$H" ]; then
      echo "== make skipped (SKIP_BUILD=1: carried build)"
    else
      echo "== make (dev/cuda)"
      make -C "$ROOT/dev/cuda" -j"$JOBS" 2>&1 || { echo "BUILD FAILED"; exit 1; }
      make -C "$ROOT/dev/cuda" build/fp8_rs 2>&1 || { echo "BUILD FAILED (fp8_rs)"; exit 1; }
    fi
    echo "== ptxas"
    cat "$ROOT"/dev/cuda/build/*.ptxas.txt
    for f in "$ROOT"/dev/cuda/build/decode_v*.ptxas.txt "$ROOT"/dev/cuda/build/combine.ptxas.txt; do
      printf 'REGS %-10s %s, %s, serialisation warnings (C7520): %s\n' "$(basename "$f" .ptxas.txt)" \
        "$(grep -o 'Used [0-9]* registers' "$f" | head -1)" "$(grep -o '[0-9]* bytes spill stores' "$f" | head -1)" \
        "$(grep -c C7520 "$f")"
    done
    echo "== SASS counts"
    for o in "$ROOT"/dev/cuda/build/decode_v*.o "$ROOT"/dev/cuda/build/desc_test.o; do
      if command -v cuobjdump > /dev/null; then
        sass=$(cuobjdump --dump-sass "$o" 2>/dev/null)
        printf 'SASS %-14s HGMMA=%s HMMA=%s UTMALDG=%s LDGSTS=%s LDL=%s STL=%s WARPGROUP.ARRIVE=%s\n' "$(basename "$o")" \
          "$(grep -c HGMMA <<< "$sass")" "$(grep -c 'HMMA' <<< "$sass")" "$(grep -c UTMALDG <<< "$sass")" \
          "$(grep -c LDGSTS <<< "$sass")" "$(grep -c 'LDL' <<< "$sass")" "$(grep -c 'STL' <<< "$sass")" \
          "$(grep -c 'WARPGROUP.ARRIVE' <<< "$sass")"
      fi
    done
  } > "$OUT/build.txt" 2>&1 || status=1
  [ -x "$H" ] || { echo "build failed; see $OUT/build.txt"; tail -30 "$OUT/build.txt"; exit 1; }
fi

if want unit; then
  { echo "== unit"; timeout 120 "$H" unit; } > "$OUT/check.txt" 2>&1 || status=1
  if [ -x "$ROOT/dev/cuda/build/fp8_rs" ]; then
    { echo "== unit fp8_rs"; timeout 60 "$ROOT/dev/cuda/build/fp8_rs" check; } >> "$OUT/check.txt" 2>&1 || status=1
  else
    echo "fp8_rs check: not built" >> "$OUT/check.txt"
  fi
fi

if want check; then
  want unit || : > "$OUT/check.txt"
  # All versions in one run (one float64 reference per case); a crash or hang
  # (exit > 1: the context is gone) is isolated by re-running one version at a time.
  echo "== check v$CHECK_VERSIONS" >> "$OUT/check.txt"
  timeout 240 "$H" check -v "$CHECK_VERSIONS" >> "$OUT/check.txt" 2>&1
  rc=$?
  crashed=""
  if [ $rc -gt 1 ]; then
    for v in ${CHECK_VERSIONS//,/ }; do
      echo "== check v$v (isolated)" >> "$OUT/check.txt"
      timeout 150 "$H" check -v "$v" >> "$OUT/check.txt" 2>&1
      r=$?
      [ $r -ne 0 ] && { echo "check v$v: exit $r" >> "$OUT/check.txt"; status=1; }
      [ $r -gt 1 ] && crashed="$crashed,$v"
    done
  elif [ $rc -ne 0 ]; then
    echo "check: exit $rc (tolerance failures)" >> "$OUT/check.txt"
    status=1
  fi
  # A version that hung or crashed (not one with tolerance failures) is left out of the bench.
  ok_versions=""
  for v in ${VERSIONS//,/ }; do [[ ",$crashed," == *",$v,"* ]] || ok_versions="$ok_versions,$v"; done
  ok_versions=${ok_versions#,}
  [ -n "$ok_versions" ] && VERSIONS=$ok_versions
fi

if want sanitize; then
  : > "$OUT/sanitize.txt"
  if command -v compute-sanitizer > /dev/null; then
    for v in ${SANITIZE_VERSIONS//,/ }; do
      if [[ " $SANITIZE_TOOLS " == *" memcheck "* ]]; then
        echo "== memcheck v$v" >> "$OUT/sanitize.txt"
        timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$H" check -v "$v" --tiny >> "$OUT/sanitize.txt" 2>&1 \
          || { echo "memcheck v$v: exit $?" >> "$OUT/sanitize.txt"; status=1; }
      fi
      if [ "$v" != 1 ] && [[ " $SANITIZE_TOOLS " == *" racecheck "* ]]; then
        echo "== racecheck v$v" >> "$OUT/sanitize.txt"
        # Reported, not fatal: racecheck flags the bar.arrive -> bar.sync handoffs of v3+
        # (PTX ISA 8.9.4: bar.arrive synchronizes with bar.sync on the same barrier);
        # read the hazard lines (docs/decode-kernel.md lists the known ones).
        timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 "$H" check -v "$v" --tiny >> "$OUT/sanitize.txt" 2>&1 \
          || echo "racecheck v$v: exit $? (hazards reported; not counted as failure)" >> "$OUT/sanitize.txt"
      fi
    done
  else
    echo "compute-sanitizer not found" >> "$OUT/sanitize.txt"
  fi
fi

if want bench; then
  {
    echo "== clocks before"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
    nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.tmp" 2>&1 &
    dmon_pid=$!
    timeout 120 "$H" copybw
    q=""; [ "$QUICK" = 1 ] && q="--quick"
    timeout 500 "$H" bench -v "$VERSIONS" $q || echo "bench: exit $?"
    timeout 200 "$H" bench -v "$VERSIONS" --b 64 --sk 4096 --h 16 --sq 1 || echo "bench b=64: exit $?"
    kill "$dmon_pid" 2> /dev/null
    wait "$dmon_pid" 2> /dev/null
    echo "== clocks after"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
    echo "== nvidia-smi dmon during the bench (pwr W, temp C, sm MHz, mem MHz)"
    cat "$OUT/dmon.tmp"
    rm -f "$OUT/dmon.tmp"
  } > "$OUT/bench.txt" 2>&1 || status=1
fi

if want noload; then
  # Timing diagnostic only: no K refills after the first tiles (wrong results; their consistency column is meaningless).
  DECODE_NOLOAD=1 timeout 200 "$H" bench -v "$VERSIONS" --quick --sq 1 --runs 15 > "$OUT/noload.txt" 2>&1 || status=1
fi

if want ncu; then
  # Hardware counters for one launch of each version at b=128 s_k=8192 (H=NCU_H, s_q=1).
  {
    for v in ${NCU_VERSIONS:-${VERSIONS//,/ }}; do
      for nh in ${NCU_HS:-128 16}; do
        echo "== ncu v$v H=$nh"
        timeout 240 ncu --clock-control none -k "regex:decode_v${v}_kernel" -s 1 -c 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
          --section WarpStateStats --section LaunchStats --section Occupancy \
          "$H" bench -v "$v" --quick --runs 1 --h "$nh" --sq 1 2>&1 | grep -v "^==PROF==" | tail -150
      done
    done
  } > "$OUT/ncu.txt" 2>&1 || status=1
fi

if want torch; then
  q=""; [ "$QUICK" = 1 ] && q="--quick"
  PYTHONUNBUFFERED=1 timeout 400 python3 "$ROOT/bench/baseline_torch_decode.py" $q > "$OUT/torch.txt" 2>&1 || status=1
  # The prefill baselines (torch SDPA backends on the prefill shapes of mla bench --device cuda).
  PYTHONUNBUFFERED=1 timeout 300 python3 "$ROOT/dev/cuda/prefill/torch_sdpa.py" > "$OUT/torch_prefill.txt" 2>&1 || status=1
fi

if want lib; then
  {
    cmake -S "$ROOT" -B "$ROOT/build-gpu" -DMLA_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      && cmake --build "$ROOT/build-gpu" -j"$JOBS" \
      && ctest --test-dir "$ROOT/build-gpu" -j"$JOBS" --output-on-failure
  } > "$OUT/lib.txt" 2>&1 || status=1
fi

if want libgpu; then
  gpu_tests=${LIBGPU_TESTS:-$(cd "$ROOT/tests" && ls test_cuda_*.c test_backend_graph.c | sed 's/\.c$//' | paste -sd' ')}
  if [ -n "$PREBUILT" ]; then
    # A carried build: each test binary in turn, in ctest's words so the summary below reads it.
    {
      n=0; nf=0
      for t in $gpu_tests; do
        n=$((n + 1))
        echo "== $t"
        if MLA_GOLDEN_DIR="$ROOT/tests/golden" timeout 900 "$LIB/tests/$t"; then echo "$t: Passed"
        else echo "$t: ***Failed (exit $?)"; nf=$((nf + 1)); fi
      done
      echo "$(( (n - nf) * 100 / n ))% tests passed, $nf tests failed out of $n"
      [ "$nf" = 0 ]
    } > "$OUT/libgpu.txt" 2>&1 || status=1
  else
    {
      cmake -S "$ROOT" -B "$LIB" -DMLA_CUDA=ON -DCMAKE_BUILD_TYPE=Release > /dev/null \
        && cmake --build "$LIB" -j"$JOBS" --target mla_cli \
          $gpu_tests \
        && ctest --test-dir "$LIB" -R "^(${gpu_tests// /|})\$" -V
    } > "$OUT/libgpu.txt" 2>&1 || status=1
    cmake --build "$LIB" -j"$JOBS" --target mla > /dev/null 2>&1
  fi
  # The Python binding's GPU tests (torch on the device) against this build.
  ( cd "$ROOT" && MLA_LIBRARY="$LIB/libmla.so" PYTHONPATH="$ROOT/python" timeout 300 \
      python3 -m pytest -q -rs python/tests/test_gpu.py python/tests/test_torch.py python/tests/test_sglang_gpu.py \
      python/tests/test_overhead.py::test_gpu_step_call_overhead ) \
    > "$OUT/pygpu.txt" 2>&1 || status=1
  q=""; [ "$QUICK" = 1 ] && q="--quick"
  timeout 400 "$LIB/mla" bench --device cuda $q ${LIBBENCH_ARGS:-} > "$OUT/libbench.txt" 2>&1 || status=1
  # The prefill against torch's SDPA backends, interleaved call by call in one process (the GPU's
  # clock moves with its temperature at the power cap; bench/prefill_vs_torch.py says why).
  ( cd "$ROOT" && MLA_LIBRARY="$LIB/libmla.so" PYTHONPATH="$ROOT/python" PYTHONUNBUFFERED=1 timeout 400 \
      python3 bench/prefill_vs_torch.py ${PREFILL_VS_TORCH_ARGS:-} ) > "$OUT/prefill_vs_torch.txt" 2>&1 || status=1
fi

if want dcp; then
  {
    nvidia-smi topo -m
    cmake -S "$ROOT" -B "$ROOT/build-gpu" -DMLA_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      && cmake --build "$ROOT/build-gpu" -j"$JOBS" --target mla_cli test_cuda_dcp_nccl \
      && NCCL_NVLS_ENABLE=0 timeout "${DCP_TIMEOUT:-300}" "$ROOT/build-gpu/tests/test_cuda_dcp_nccl" \
      && NCCL_NVLS_ENABLE=0 timeout "${DCP_TIMEOUT:-300}" "$ROOT/build-gpu/mla" bench --dcp 2 ${DCP_BENCH_ARGS:-}
  } > "$OUT/dcp.txt" 2>&1 || status=1
fi

if want libsan; then
  # compute-sanitizer over the library's kernels on small grids (the tests' "small" mode):
  # memcheck must be clean; racecheck hazards are reported (the wgmma/TMA kernels order
  # shared memory through mbarriers, which racecheck models only in part).
  {
    [ -n "$PREBUILT" ] || { cmake -S "$ROOT" -B "$LIB" -DMLA_CUDA=ON -DCMAKE_BUILD_TYPE=Release > /dev/null \
      && cmake --build "$LIB" -j"$JOBS" --target test_cuda_prefill_paged test_cuda_ragged test_cuda_cache \
        test_cuda_step test_cuda_decode_dtypes > /dev/null; }
    for t in "test_cuda_prefill_paged small" "test_cuda_ragged small" "test_cuda_cache" "test_cuda_step" \
        "test_cuda_decode_dtypes --small"; do
      echo "== memcheck $t"
      timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$LIB/tests/"$t 2>&1 | tail -3
      echo "exit ${PIPESTATUS[0]}"
    done
    for t in "test_cuda_prefill_paged small" "test_cuda_ragged small" "test_cuda_decode_dtypes --small"; do
      echo "== racecheck $t"
      timeout 300 compute-sanitizer --tool racecheck --print-limit 6 "$LIB/tests/"$t 2>&1 \
        | grep -v "^  [a-z]" | head -60
    done
  } > "$OUT/libsan.txt" 2>&1
  grep -q "^exit [1-9]" "$OUT/libsan.txt" && status=1
fi

# ---- short table, printed last -------------------------------------------
{
  echo "==== gpu-check summary ($(date -u +%F), tree $(git -C "$ROOT" describe --always --dirty 2>/dev/null))"
  [ -n "$PREBUILT" ] && echo "prebuilt binaries: $(cat "$LIB/SOURCE" 2>/dev/null || echo "no SOURCE file in $LIB")"
  [ -f "$OUT/env.txt" ] && grep -A1 "^name, clocks" "$OUT/env.txt" | tail -1 | sed 's/^/gpu: /'
  [ -f "$OUT/build.txt" ] && grep -E "^SASS|BUILD FAILED" "$OUT/build.txt"
  [ -f "$OUT/build.txt" ] && grep -E "^REGS" "$OUT/build.txt"
  [ -f "$OUT/check.txt" ] && sed -n '/^== unit/,/^== check/p' "$OUT/check.txt" | grep "desc_test"
  [ -f "$OUT/check.txt" ] && grep -E "^(check: S max|fp8_rs)" "$OUT/check.txt" | sed 's/^check:/fp8_rs check:/'
  if [ -f "$OUT/check.txt" ]; then
    for v in ${CHECK_VERSIONS//,/ }; do
      p=$(grep -c "^CHECK v$v .*PASS$" "$OUT/check.txt"); f=$(grep -c "^CHECK v$v .*FAIL" "$OUT/check.txt")
      echo "check v$v: $p pass, $f fail $(grep -m1 "check v$v: exit" "$OUT/check.txt")"
    done
    grep -m1 "own reference vs" "$OUT/check.txt"
    grep "^CHECK .*FAIL" "$OUT/check.txt" | head -8
  fi
  [ -f "$OUT/libsan.txt" ] && grep -E "^== |ERROR SUMMARY|RACECHECK SUMMARY|^exit" "$OUT/libsan.txt" | paste -sd' ' \
    | sed 's/== /\n/g' | grep -v '^$' | sed 's/^/libsan: /'
  if [ -f "$OUT/sanitize.txt" ]; then
    grep -E "^== |ERROR SUMMARY|RACECHECK SUMMARY|exit [0-9]" "$OUT/sanitize.txt" | paste -sd' ' | sed 's/== /\n/g' | grep -v '^$' | sed 's/^/sanitize: /'
  fi
  [ -f "$OUT/bench.txt" ] && grep -E "^COPYBW" "$OUT/bench.txt"
  [ -f "$OUT/torch.txt" ] && grep -E "^MATMUL|^COPY" "$OUT/torch.txt"
  [ -f "$OUT/torch_prefill.txt" ] && tail -12 "$OUT/torch_prefill.txt" | sed 's/^/torch prefill: /'
  [ -f "$OUT/prefill_vs_torch.txt" ] && sed -n '/^# summary/,$p' "$OUT/prefill_vs_torch.txt" | sed 's/^/prefill vs torch: /'
  if [ -f "$OUT/bench.txt" ]; then
    echo "shape (P=64)                  | version: us (TFLOP/s, GB/s) ... | torch us"
    grep "^BENCH" "$OUT/bench.txt" | awk -v tf="$OUT/torch.txt" '
      BEGIN { while ((getline l < tf) > 0) if (l ~ /^TORCH/) { split(l, a, " "); k = a[2] " " a[3] " " a[4] " " a[5]; sub("t_us=", "", a[7]); t[k] = a[7] } }
      { k = $3 " " $4 " " $5 " " $6; for (i = 1; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
        if (!(k in seen)) { order[++n] = k; seen[k] = 1 }
        row[k] = row[k] sprintf(" %s: %s (%s, %s)", $2, f["t_us"], f["tflops"], f["gbs"]) }
      END { for (i = 1; i <= n; i++) printf "%-29s |%s | %s\n", order[i], row[order[i]], (order[i] in t) ? t[order[i]] : "-" }'
    grep "^BENCH" "$OUT/bench.txt" | awk '{print $NF}' | grep -v "=0.00e+00" | sort | uniq -c | sed 's/^/consistency vs first version: /'
    grep -A2 "clocks after" "$OUT/bench.txt" | tail -1 | sed 's/^/clocks after bench (sm, mem, W, C): /'
  fi
  if [ -f "$OUT/noload.txt" ]; then
    grep "^BENCH" "$OUT/noload.txt" | awk '{ for (i = 1; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      printf "noload %s %s %s %s: %s us\n", $2, $3, $5, $6, f["t_us"] }'
  fi
  [ -f "$OUT/lib.txt" ] && tail -3 "$OUT/lib.txt"
  [ -f "$OUT/libgpu.txt" ] && grep -E "tests passed|tests failed|: test_cuda_[a-z_]*: [0-9]+ passed|skipped|FAIL|\*\*\*Failed" "$OUT/libgpu.txt" | head -40
  [ -f "$OUT/pygpu.txt" ] && tail -3 "$OUT/pygpu.txt" | sed 's/^/python gpu: /'
  [ -f "$OUT/libbench.txt" ] && cat "$OUT/libbench.txt"
  [ -f "$OUT/dcp.txt" ] && grep -E "^-- NCCL|^NCCL [0-9]|test_cuda_dcp_nccl: [0-9]+ passed|skipped|^FAIL|max \|o\(|^DCP |GPUs? *:|rank [0-9]: att|speed-up|^mla bench" "$OUT/dcp.txt" | sed 's/^/dcp: /'
  echo "status: $status"
} | tee "$OUT/summary.txt"
exit $status
