#!/usr/bin/env bash
# Packs the binaries of a CUDA build made here for a device run of
# `PREBUILT=b scripts/gpu-check.sh libgpu` (or of single test binaries):
# BUILD_DIR's mla, libmla.so* and the named tests (default: every GPU test,
# test_cuda_*.c and test_backend_graph.c, as gpu-check.sh's libgpu runs them),
# stripped, under a top folder `b/`, xz-compressed into OUT.tgz (the *-bin.tgz
# names in the repository root are ignored by git; carry the file and the run
# script, then `tar xJf OUT.tgz` on the device), with b/SOURCE naming the commit
# the binaries were built from (gpu-check.sh prints it). Builds the targets first.
#
#   scripts/pack-prebuilt.sh BUILD_DIR OUT.tgz [TEST...]
#
# BUILD_DIR  a tree configured with -DMLA_CUDA=ON -DCMAKE_BUILD_TYPE=Release.
# (With the Ninja generator `--target mla` names the CLI, whose output file is
# `mla`, not the shared library: the library is built as `libmla.so` there.)
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,15p' "$0"; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=$(cd "$1" && pwd); OUTF=$2; shift 2
tests=("$@")
[ ${#tests[@]} -gt 0 ] || mapfile -t tests < <(cd "$ROOT/tests" && ls test_cuda_*.c test_backend_graph.c | sed 's/\.c$//')
lib=mla
grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja' "$B/CMakeCache.txt" && lib=libmla.so
cmake --build "$B" -j"$(nproc)" --target "$lib" mla_cli "${tests[@]}" > /dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/b/tests"
cp -a "$B/mla" "$B"/libmla.so* "$tmp/b/"
# which source the binaries are (gpu-check.sh prints it: the device's copy of the tree may be another commit)
src=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$ROOT" diff --quiet HEAD -- src include 2>/dev/null || src="$src+uncommitted src/include"
echo "$src (packed $(date -u +%FT%TZ) from $ROOT)" > "$tmp/b/SOURCE"
for t in "${tests[@]}"; do cp "$B/tests/$t" "$tmp/b/tests/"; done
strip "$tmp/b/mla" "$tmp"/b/tests/* "$(readlink -f "$tmp/b/libmla.so")"
(cd "$tmp" && tar cf - b) | xz -9 -T2 > "$OUTF"
echo "$OUTF: $(du -h "$OUTF" | cut -f1), mla + libmla.so + ${#tests[@]} tests"
