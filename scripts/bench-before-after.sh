#!/usr/bin/env bash
# Prefill and decode of one model under two builds of maxrun (say before and
# after a kernel change), each on its own artifact (a format change needs each
# build's own), in ABBA rounds seconds apart so that both see the same machine:
# a shared VM's bandwidth moves between minutes. Prints each run and the mean
# ratio after/before per test.
#   scripts/bench-before-after.sh OLD_MAXRUN OLD.mef NEW_MAXRUN NEW.mef   (env: THREADS=2, ROUNDS=4, PROMPT=64, TOKENS=128)
set -euo pipefail
[ $# -eq 4 ] || { echo "usage: $0 OLD_MAXRUN OLD.mef NEW_MAXRUN NEW.mef" >&2; exit 2; }
old=("$1" "$2"); new=("$3" "$4")
threads="${THREADS:-2}"; rounds="${ROUNDS:-4}"; p="${PROMPT:-64}"; n="${TOKENS:-128}"
# One run: "pp tok/s<TAB>tg tok/s" from maxrun bench's table.
run() {
    "$1" bench "$2" -p "$p" -n "$n" -r 2 --threads "$threads" 2>/dev/null \
        | awk -F'|' -v p="pp$p" -v n="tg$n" '$4 ~ p {split($5, a, " "); pp = a[1]} $4 ~ n {split($5, a, " "); tg = a[1]} END {printf "%s\t%s\n", pp, tg}'
}
rows=()
for r in $(seq "$rounds"); do
    for which in old new new old; do
        if [ "$which" = old ]; then line="$(run "${old[@]}")"; else line="$(run "${new[@]}")"; fi
        echo "round $r $which: pp$p ${line%%$'\t'*} tok/s, tg$n ${line##*$'\t'} tok/s"
        rows+=("$which"$'\t'"$line")
    done
done
printf '%s\n' "${rows[@]}" | awk -F'\t' '{pp[$1] += $2; tg[$1] += $3; k[$1]++}
    END {printf "mean: before pp %.1f tg %.1f, after pp %.1f tg %.1f; after/before: prefill %.3fx, decode %.3fx\n",
        pp["old"]/k["old"], tg["old"]/k["old"], pp["new"]/k["new"], tg["new"]/k["new"], (pp["new"]/k["new"])/(pp["old"]/k["old"]), (tg["new"]/k["new"])/(tg["old"]/k["old"])}'
