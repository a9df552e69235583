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
# CASE             "b H s_q s_k dtype page [spread]", e.g. "128 128 1 8192 bf16 64" (spread: the
#                  bench's --kv-spread, request lengths uniform in s_k (1 +- spread %)), or
#                  `ragged`: the bench's ragged prefill rows (causal 192/128,
#                  H=128: 1 x 8K, 1 x 16K, 16 x 1K; one row each in the table).
# -r ROUNDS        rounds (default 2); -n RUNS: `--runs` per case (default 20).
# -e VAR=VALUE     exported for every build (e.g. -e MLA_DECODE_MC=0).
#
# Example (device):
#   scripts/ab-bench.sh -r 2 old=bo/mla new=bn/mla -- "128 128 1 8192 bf16 64" "128 16 1 8192 bf16 64"
#   scripts/ab-bench.sh -r 2 hg2=b/mla hg8@MLA_PREFILL_HEAD_GROUP=8=b/mla -- ragged
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

declare -A res seen  # seen: the ragged rows met (their names come from the bench's output)
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
      if [ "$c" = ragged ]; then
        # one call, three rows: "seqs len t_us TFLOP/s" under the ragged header
        out=$(env ${envset[@]+"${envset[@]}"} "$path" bench --device cuda --b 1 --h 16 --sq 1 --sk 4096 --dtype bf16 \
          --no-kv-write --runs "$runs" 2>&1)
        while read -r seqs len t; do
          row="ragged ${seqs}x${len}"
          echo "round $r  $name  [$row]  $t"
          res["$name|$row"]+="${res["$name|$row"]:+ / }$t"
          seen["$row"]=1
        done < <(awk '/ragged MHA/{f=1;next} /^#/{f=0} f && $1 ~ /^[0-9]+$/ {print $1, $2, $3}' <<<"$out")
        continue
      fi
      read -r cb ch cq ck cd cp cs <<<"$c"
      spread=()
      [ -n "$cs" ] && spread=(--kv-spread "$cs")
      line=$(env ${envset[@]+"${envset[@]}"} "$path" bench --device cuda --b "$cb" --h "$ch" --sq "$cq" --sk "$ck" --dtype "$cd" \
        --page-size "$cp" ${spread[@]+"${spread[@]}"} --no-prefill --no-kv-write --runs "$runs" 2>&1 | tail -n 1)
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
rows=()
for c in "${cases[@]}"; do
  if [ "$c" = ragged ]; then
    while read -r k; do rows+=("$k"); done < <(printf '%s\n' "${!seen[@]}" | grep '^ragged' | sort -t x -k2 -n)
  else
    rows+=("$c")
  fi
done
for c in "${rows[@]}"; do
  printf '%-28s' "$c"
  for b in "${builds[@]}"; do n=${b%%=*}; printf ' | %-24s' "${res["${n%%@*}|$c"]}"; done
  echo
done
