#!/usr/bin/env bash
# `linattn eval --profile full` on the lent H200 with fla, FlashQLA and SDPA side by side, as four device calls on
# one warm machine (docs/eval.md, "GPU runs with fla and FlashQLA": the recipe this script encodes).
#
#   bash benchmarks/eval_h200.sh N        # N = 1..4, in the device call, from the repository root, carry .anchors
#
# Part N runs its sections with its own budget (the four fit in ≈ 25 device minutes, cold start not included) and
# writes out/eval-full-N/ (out/ is git-ignored, so it survives between calls on a warm machine and later parts pass
# the earlier ones to --warm-from), then copies it to $OUT. Merge on any machine afterwards:
#
#   linattn eval --merge eval-full-1 eval-full-2 eval-full-3 eval-full-4 --allow-partial --out merged
set -euo pipefail
part=${1:?usage: eval_h200.sh PART (1-4)}
case $part in
  1) sections=correctness,robustness,scorecard; budget=300 ;;
  2) sections=performance,decode,scorecard; budget=480 ;;
  3) sections=scaling,memory,scorecard; budget=300 ;;
  4) sections=stability,soak,mixed_precision,scorecard; budget=300 ;;
  *) echo "part must be 1, 2, 3 or 4, got $part" >&2; exit 2 ;;
esac
budget=${EVAL_BUDGET:-$budget}  # a smaller budget for a smoke run (e.g. EVAL_BUDGET=40 on a CPU)
# fla and FlashQLA come from the anchors' site-packages tarball (../shared/anchors/pack_anchors.sh)
[ -d /tmp/site/fla ] || { mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz; }
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_AUTOTUNING=1  # fla's autotune results stay on disk for the later parts (docs/eval.md)
warm=()
for ((i = 1; i < part; i++)); do
  [ -f "out/eval-full-$i/report.json" ] && warm+=("out/eval-full-$i")
done
mkdir -p out
rc=0
timeout -k 20 $((budget + 80)) python3 -m linattn.cli eval --profile full --impl linattn,fla,flashqla,sdpa \
  --time-budget "$budget" --no-progress --sections "$sections" --out "out/eval-full-$part" \
  ${warm[@]+--warm-from "${warm[@]}"} > "out/eval-full-$part.log" 2>&1 || rc=$?
mkdir -p "out/eval-full-$part"
cp "out/eval-full-$part.log" "out/eval-full-$part/run.log"
[ -n "${OUT:-}" ] && cp -r "out/eval-full-$part" "$OUT/"
tail -40 "out/eval-full-$part.log"
echo "eval part $part: exit $rc, warm from: ${warm[*]:-none}"
exit $rc
