#!/bin/sh
# ctest `python_binding`: the pytest suite of python/ (python/tests) against the
# library of this build (MLA_LIBRARY, set by ctest), with the C layout helper
# (MLA_LAYOUT_HELPER).
#
# usage: run_ctest.sh <repository root>
#
# Passes with a line "skipped: ..." when python3, numpy or pytest is missing
# (CI machines need not have them). In a sanitizer build (MLA_ASAN_RUNTIME set
# by ctest) the ASan runtime is preloaded: python3 itself is not instrumented,
# and ASan must come first in the process. Leak checking is off there (the
# interpreter keeps its allocations to the end); everything else ASan and
# UBSan check stays fatal.
set -u
ROOT=$1
PY=${MLA_PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || {
  echo "skipped: $PY not found (the Python binding's tests need python3, numpy and pytest)"
  exit 0
}
for m in numpy pytest; do
  "$PY" -c "import $m" >/dev/null 2>&1 || {
    echo "skipped: the Python module '$m' is not installed for $PY (pip install numpy pytest)"
    exit 0
  }
done
if [ -n "${MLA_ASAN_RUNTIME:-}" ]; then
  [ -f "$MLA_ASAN_RUNTIME" ] || {
    echo "skipped: sanitizer build, and its ASan runtime ($MLA_ASAN_RUNTIME) was not found to preload into python3"
    exit 0
  }
  export LD_PRELOAD="$MLA_ASAN_RUNTIME${LD_PRELOAD:+:$LD_PRELOAD}"
  export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1"
fi
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 # keep the source tree clean
exec "$PY" -m pytest "$ROOT/python/tests" -q -p no:cacheprovider
