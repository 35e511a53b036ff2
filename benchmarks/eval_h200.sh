#!/usr/bin/env bash
# `linattn eval --profile full` on the lent H200 with fla, FlashQLA and SDPA side by side, as device calls on one
# warm machine (docs/eval.md, "GPU runs with fla and FlashQLA": the recipe this script encodes).
#
#   bash benchmarks/eval_h200.sh N        # in the device call, from the repository root, carry .anchors
#
# Part N = 1..4 runs its sections with its own budget (the four fit in ≈ 25 device minutes, cold start not
# included) and writes out/eval-full-N/ (out/ is git-ignored, so it survives between calls on a warm machine and
# later parts pass the earlier ones to --warm-from), then copies it to $OUT. Merge on any machine afterwards:
#
#   linattn eval --merge eval-full-1 eval-full-2 eval-full-3 eval-full-4 --allow-partial --out merged
#
# Environment (all optional):
#   EVAL_SECTIONS=a,b   the sections of this part instead of part N's (then N may be any number from 1: 5, 6, ...)
#   EVAL_BUDGET=S       the part's budget in seconds (e.g. 40 for a smoke run on a CPU)
#   RESUME=REPORT       an earlier session's report (report.json, or report.json.gz, e.g. the committed
#                       docs/eval-h200-*/report.json.gz): --resume from it and from this machine's earlier parts,
#                       so only the units no run measured are run (docs/eval.md, "Resuming"); then merge with
#                       that report first and --prefer-last
#   RESUME_IMPLS=a,b    --resume-impls: carry only these implementations' records (e.g. fla,flashqla,sdpa after a
#                       change to linattn)
#   RESUME_REDO=p,q     --resume-redo: measure again the records whose id matches a pattern (e.g.
#                       'linattn/*/fp32,linattn/*/fp32/*' after a change to linattn's fp32 path)
set -euo pipefail
part=${1:?usage: eval_h200.sh PART (1-4, or any with EVAL_SECTIONS)}
case $part in
  1) sections=correctness,robustness,scorecard; budget=300 ;;
  2) sections=performance,decode,scorecard; budget=480 ;;
  3) sections=scaling,memory,scorecard; budget=300 ;;
  4) sections=stability,soak,mixed_precision,scorecard; budget=300 ;;
  *) [[ -n "${EVAL_SECTIONS:-}" && $part =~ ^[0-9]+$ && $part -ge 1 ]] || {
       echo "part must be 1, 2, 3 or 4 (or a number with EVAL_SECTIONS set), got $part" >&2; exit 2; }
     sections=; budget=480 ;;
esac
sections=${EVAL_SECTIONS:-$sections}
budget=${EVAL_BUDGET:-$budget}
# fla and FlashQLA come from the anchors' site-packages tarball (../shared/anchors/pack_anchors.sh)
[ -d /tmp/site/fla ] || { mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz; }
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_AUTOTUNING=1  # fla's autotune results stay on disk for the later parts (docs/eval.md)
warm=()
for ((i = 1; i < part; i++)); do
  [ -f "out/eval-full-$i/report.json" ] && warm+=("out/eval-full-$i")
done
resume=()
if [ -n "${RESUME:-}" ]; then
  earlier=$RESUME
  if [[ $RESUME == *.gz ]]; then earlier=out/resume-from.json; mkdir -p out; gunzip -c "$RESUME" > "$earlier"; fi
  resume=(--resume "$earlier" ${warm[@]+"${warm[@]}"})
  [ -n "${RESUME_IMPLS:-}" ] && resume+=(--resume-impls "$RESUME_IMPLS")
  [ -n "${RESUME_REDO:-}" ] && resume+=(--resume-redo "$RESUME_REDO")
fi
mkdir -p out
rc=0
timeout -k 20 $((budget + 80)) python3 -m linattn.cli eval --profile full --impl linattn,fla,flashqla,sdpa \
  --time-budget "$budget" --no-progress --sections "$sections" --out "out/eval-full-$part" \
  ${warm[@]+--warm-from "${warm[@]}"} ${resume[@]+"${resume[@]}"} > "out/eval-full-$part.log" 2>&1 || rc=$?
mkdir -p "out/eval-full-$part"
cp "out/eval-full-$part.log" "out/eval-full-$part/run.log"
[ -n "${OUT:-}" ] && cp -r "out/eval-full-$part" "$OUT/"
tail -40 "out/eval-full-$part.log"
# the compile caches this machine holds now: whether carrying them to the next session's fresh machine would fit
# the device tool's 64 MiB (with the 53 MB anchors tarball) and spare fla's and FlashQLA's 40-134 s compiles
du -sh "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" "${TILELANG_CACHE_DIR:-$HOME/.tilelang}" 2>/dev/null || true
echo "eval part $part ($sections, budget $budget s): exit $rc, warm from: ${warm[*]:-none}, resume: ${resume[*]:-none}"
exit $rc
