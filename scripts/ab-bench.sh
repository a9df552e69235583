#!/usr/bin/env bash
# Interleaved A/B timing of decode builds in one device call (the pattern of
# bench/RESULTS.md sessions 9-10): each build's `mla bench --device cuda` on
# each case, round after round, so clock and temperature drift hit every
# build alike. Prints one line per (round, build, case) and a table of the
# medians' per-round values last.
#
#   scripts/ab-bench.sh [-r ROUNDS] [-n RUNS] [-e VAR=VALUE]... NAME=MLA_BINARY... -- CASE...
#
# NAME=MLA_BINARY  a label and the path of an `mla` binary (e.g. one unpacked
#                  from a carried tarball); two or more. A label may carry an
#                  environment setting for that build only: NAME@VAR=VALUE=PATH.
# CASE             "b H s_q s_k dtype page", e.g. "128 128 1 8192 bf16 64".
# -r ROUNDS        rounds (default 2); -n RUNS: `--runs` per case (default 20).
# -e VAR=VALUE     exported for every build (e.g. -e MLA_DECODE_MC=0).
#
# Example (device):
#   scripts/ab-bench.sh -r 2 old=bo/mla new=bn/mla -- "128 128 1 8192 bf16 64" "128 16 1 8192 bf16 64"
set -u
rounds=2
runs=20
builds=()
cases=()
while [ $# -gt 0 ]; do
  case "$1" in
  -r) rounds=$2; shift 2 ;;
  -n) runs=$2; shift 2 ;;
  -e) export "${2?}"; shift 2 ;;
  --) shift; cases=("$@"); break ;;
  *=*) builds+=("$1"); shift ;;
  *) echo "ab-bench: unknown argument '$1' (see the header)" >&2; exit 2 ;;
  esac
done
if [ ${#builds[@]} -lt 1 ] || [ ${#cases[@]} -lt 1 ]; then
  echo "ab-bench: need NAME=MLA_BINARY... -- CASE... (see the header)" >&2
  exit 2
fi

declare -A res
for ((r = 1; r <= rounds; r++)); do
  for b in "${builds[@]}"; do
    name=${b%%=*}
    path=${b#*=}
    envset=()
    if [[ $name == *@* ]]; then  # NAME@VAR=VALUE=PATH
      envset=("${name#*@}=${path%%=*}")
      name=${name%%@*}
      path=${path#*=}
    fi
    for c in "${cases[@]}"; do
      read -r cb ch cq ck cd cp <<<"$c"
      line=$(env ${envset[@]+"${envset[@]}"} "$path" bench --device cuda --b "$cb" --h "$ch" --sq "$cq" --sk "$ck" --dtype "$cd" \
        --page-size "$cp" --no-prefill --no-kv-write --runs "$runs" 2>&1 | tail -n 1)
      t=$(awk '{print $6}' <<<"$line")
      [[ $t =~ ^[0-9.]+$ ]] || t="($line)"
      echo "round $r  $name  [$c]  $t"
      res["$name|$c"]+="${res["$name|$c"]:+ / }$t"
    done
  done
done

echo
printf '%-28s' "case (b H s_q s_k dtype page)"
for b in "${builds[@]}"; do n=${b%%=*}; printf ' | %-24s' "${n%%@*}"; done
echo
for c in "${cases[@]}"; do
  printf '%-28s' "$c"
  for b in "${builds[@]}"; do n=${b%%=*}; printf ' | %-24s' "${res["${n%%@*}|$c"]}"; done
  echo
done
