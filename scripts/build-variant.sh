#!/usr/bin/env bash
# Builds one A/B variant of the CUDA decode kernels without touching the build
# tree: src/cuda/decode_sm90.cu compiled with extra definitions into a copy of
# the tree's libmla.a, then `mla` and the named tests linked against that copy.
# (Compiling the variant object into the tree and relinking with ninja does
# not work: ninja rebuilds the object from the default flags first, silently;
# bench/RESULTS.md session 15.) Check the result before timing it, e.g.
# cuobjdump -sass OUT/mla | grep -o 'decode_ring_kernelI[^ ]*'.
#
#   scripts/build-variant.sh BUILD_DIR OUT_DIR "DEFS" [TEST...]
#
# BUILD_DIR  a built CUDA tree configured with -G Ninja -DMLA_CUDA=ON
#            -DCMAKE_EXPORT_COMPILE_COMMANDS=ON (built with the default flags)
# OUT_DIR    receives mla and tests/TEST...
# DEFS       e.g. "-DMLA_DEV_TIMELINE -DMLA_DEV_NOLOAD"
# VARIANT_SRC (environment) the file under src/cuda/ to compile with DEFS
#            (default decode_sm90.cu; e.g. prefill_sm90.cu)
# VARIANT_FROM (environment) compile this file in its place (e.g. the same
#            file in another worktree holding a patch), with the tree's flags
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,19p' "$0"; exit 2; }
B=$(cd "$1" && pwd); mkdir -p "$2/tests"; D=$(cd "$2" && pwd); DEFS=$3; shift 3
SRC=$(cd "$(dirname "$0")/.." && pwd)/src/cuda/${VARIANT_SRC:-decode_sm90.cu}
cd "$B"
ninja mla_cli "$@" > /dev/null  # the default tree up to date first
cmd=$(python3 - "$SRC" <<'PY'
import json, sys
src = sys.argv[1]
c = [x for x in json.load(open("compile_commands.json")) if x["file"] == src][0]["command"]
print(c)
PY
)
obj=$(sed -E 's/.* -o ([^ ]+)$/\1/' <<<"$cmd")
cmd=${cmd% -o *}
[ -z "${VARIANT_FROM:-}" ] || cmd=${cmd//$SRC/$(readlink -f "$VARIANT_FROM")}
OBJ=$(basename "$SRC").o
eval "$cmd $DEFS -o $D/$OBJ"
cp libmla.a "$D/libmla.a"
(cd "$D" && ar r libmla.a "$OBJ")
relink() {  # relink TARGET OUTPUT: the target's link command with the copy of libmla.a
  local l
  l=$(ninja -t commands "$1" | tail -n 1)
  l=${l// libmla.a / $D/libmla.a }
  l=${l/-o $2 /-o $D/$2 }
  eval "$l"
}
relink mla_cli mla
for t in "$@"; do relink "$t" "tests/$t"; done
rm -f "$D/libmla.a" "$D/$OBJ"
echo "build-variant: $D/mla${*:+ and tests: $*} ($DEFS; object was $obj)"
