#!/usr/bin/env bash
# The PTX of src/cuda/decode_sm90.cu (or VARIANT_SRC) as the build compiles
# it, with what changes between identical builds masked (.loc / .file and
# debug .b8-.b64 data lines, the anonymous namespace's and the file's
# hashes): two trees' outputs compare with cmp. How the "PTX identical"
# claims in bench/RESULTS.md and the commit messages were checked.
#
#   scripts/ptx-masked.sh BUILD_DIR OUT.ptx ["DEFS"]
#
# BUILD_DIR  a CUDA tree configured with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
# DEFS       extra definitions, e.g. "-DMLA_DEV_TIMELINE"
# Example: scripts/ptx-masked.sh build-pb /tmp/new.ptx; git stash;
#          scripts/ptx-masked.sh build-pb /tmp/old.ptx; git stash pop; cmp /tmp/old.ptx /tmp/new.ptx
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,13p' "$0"; exit 2; }
B=$(cd "$1" && pwd); OUTP=$(realpath -m "$2"); DEFS=${3:-}
SRC=$(cd "$(dirname "$0")/.." && pwd)/src/cuda/${VARIANT_SRC:-decode_sm90.cu}
cmd=$(python3 - "$B/compile_commands.json" "$SRC" <<'PY'
import json, sys
c = [x for x in json.load(open(sys.argv[1])) if x["file"] == sys.argv[2]][0]
print(c["command"].split(" -o ")[0])
PY
)
cmd=$(sed -E 's/-gencode[= ][^ ]+//g; s/ -c / /' <<<"$cmd")
(cd "$B" && eval "$cmd $DEFS -ptx -arch=sm_90a -o $OUTP.raw")
grep -vE '^\s*\.(loc|file)|^\s*\.b(8|16|32|64) ' "$OUTP.raw" \
  | sed -E 's/_GLOBAL__N__[0-9a-f_]+/_GN_/g; s/[0-9a-f]{8}_[0-9]+_[a-z0-9_]+_cu_[0-9a-f]+/H/g' > "$OUTP"
rm -f "$OUTP.raw"
echo "ptx-masked: $OUTP ($(wc -l < "$OUTP") lines${DEFS:+; $DEFS})"
