#!/usr/bin/env bash
# The full test run: README "Build and run the tests", and what CI runs (.ci/run).
#
#   1. build/       the test suite, as configured by default (the CUDA part too
#                   when nvcc is found), ctest -j2
#   2. build-asan/  the whole suite again under AddressSanitizer (with
#                   LeakSanitizer) + UndefinedBehaviorSanitizer, RelWithDebInfo
#                   (optimised: Debug would make the CPU kernel tests crawl).
#                   CPU only: the CUDA runtime and ASan do not mix, and the GPU
#                   tests ran in stage 1.
#   3. build-fuzz/  the libFuzzer target fuzz/fuzz_api for MLA_FUZZ_SECONDS
#                   (default 60), when clang with libFuzzer is installed;
#                   otherwise "skipped: ...". Its corpus and regression inputs
#                   are also replayed by ctest (fuzz_replay) in stages 1 and 2.
#
# The last line is "N passed, M failed": ctest tests of stages 1 and 2 plus the
# fuzz run (a build that fails counts as one failure). Exit status 0 only when
# M is 0. Environment: MLA_TEST_JOBS (default 2), MLA_FUZZ_SECONDS (default 60).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

JOBS=${MLA_TEST_JOBS:-2}
FUZZ_SECONDS=${MLA_FUZZ_SECONDS:-60}
PASSED=0
FAILED=0

# Sanitizer reports are fatal, and leaks fail the program (LeakSanitizer runs
# at exit, exit status 23). Caller's options come first; ours win.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=1:halt_on_error=1"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}print_stacktrace=1:halt_on_error=1"

banner() { printf '\n==== %s\n' "$*"; }

# run_suite NAME BUILD_DIR [cmake options...]: configure, build, ctest; adds
# ctest's counts (or one failure when the build breaks) to the totals.
run_suite() {
  local name=$1 dir=$2
  shift 2
  banner "$name: configure and build ($dir)"
  if ! cmake -S . -B "$dir" "$@" || ! cmake --build "$dir" -j "$JOBS"; then
    echo "---- $name: BUILD FAILED"
    FAILED=$((FAILED + 1))
    return
  fi
  banner "$name: ctest"
  local log=$dir/ctest.log
  ctest --test-dir "$dir" --output-on-failure -j "$JOBS" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  # "100% tests passed, 0 tests failed out of 26"
  local counts
  counts=$(sed -n 's/.*tests passed, \([0-9][0-9]*\) tests* failed out of \([0-9][0-9]*\).*/\1 \2/p' "$log" | tail -n 1)
  if [ -z "$counts" ]; then
    echo "---- $name: no ctest summary (exit status $rc)"
    FAILED=$((FAILED + 1))
    return
  fi
  local f=${counts% *} total=${counts#* }
  PASSED=$((PASSED + total - f))
  FAILED=$((FAILED + f))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then FAILED=$((FAILED + 1)); fi
  echo "---- $name: $((total - f)) passed, $f failed"
}

# Stage 3: clang must link a libFuzzer program (the runtime is a separate
# Debian package, e.g. libclang-rt-14-dev / llvm's compiler-rt).
have_libfuzzer() {
  command -v clang >/dev/null 2>&1 || { echo "clang is not installed"; return 1; }
  local tmp
  tmp=$(mktemp -d) || return 1
  printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' >"$tmp/f.c"
  if ! clang -fsanitize=fuzzer,address,undefined "$tmp/f.c" -o "$tmp/f" >"$tmp/log" 2>&1; then
    echo "clang cannot link -fsanitize=fuzzer (libFuzzer runtime missing): $(head -n 1 "$tmp/log")"
    rm -rf "$tmp"
    return 1
  fi
  rm -rf "$tmp"
}

run_fuzz() {
  banner "fuzz: libFuzzer target fuzz/fuzz_api for ${FUZZ_SECONDS} s (build-fuzz)"
  local why
  if ! why=$(have_libfuzzer); then
    echo "skipped: fuzzing ($why)"
    return
  fi
  if ! cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DMLA_FUZZ=ON -DMLA_CUDA=OFF \
       -DBUILD_TESTING=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo ||
     ! cmake --build build-fuzz -j "$JOBS" --target fuzz_api; then
    echo "---- fuzz: BUILD FAILED"
    FAILED=$((FAILED + 1))
    return
  fi
  # New inputs go to build-fuzz/corpus (the checked-in corpus stays as it is);
  # a crashing input is written to build-fuzz/artifacts/.
  mkdir -p build-fuzz/corpus build-fuzz/artifacts
  if ./build-fuzz/fuzz/fuzz_api -max_total_time="$FUZZ_SECONDS" -max_len=2048 -timeout=30 \
       -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/ \
       build-fuzz/corpus fuzz/corpus fuzz/regressions 2>&1 | grep -v -e '^#[0-9]' -e '^	NEW_FUNC'; [ "${PIPESTATUS[0]}" -eq 0 ]; then
    PASSED=$((PASSED + 1))
    echo "---- fuzz: passed"
  else
    FAILED=$((FAILED + 1))
    echo "---- fuzz: FAILED; the input is in build-fuzz/artifacts/ (copy it to fuzz/regressions/)"
  fi
}

START=$(date +%s)
run_suite "tests" build
run_suite "tests under ASan+UBSan" build-asan -DMLA_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMLA_CUDA=OFF
run_fuzz
echo
echo "scripts/test.sh: $(($(date +%s) - START)) s"
echo "$PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
