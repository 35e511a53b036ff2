#!/usr/bin/env bash
# The Hopper forward's GPU checks that run 22 switched pieces on by (docs/performance.md): the TileLang pre-pass,
# the segmented forward at a slow decay, the role-split kernel (correct there, not faster: off). Each mode runs
# `hopper_fwd_check.py --<mode> --quick` in its own process under a time limit (a wrong mbarrier hangs the
# role-split kernel), so one failure does not stop the others; JSON results under $OUT, the tables on stdout. Needs
# .anchors/ (TileLang 0.1.15 in the anchors' site packages; fla is left out of the copy: not needed here).
#
#     bash benchmarks/hopper_pending_checks.sh prepass segmented     # ≈ 2 min with the compiles (run 22)
#     bash benchmarks/hopper_pending_checks.sh roles                 # ≈ 1.5 min (run 22)
#     bash benchmarks/hopper_pending_checks.sh variants prepass segmented profile-cython   # session 18
set -u
OUT=${OUT:-.}
modes=${*:-prepass segmented roles}
mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz && rm -rf /tmp/site/fla || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
for mode in $modes; do
    limit=$([ "$mode" = roles ] && echo 420 || echo 240)
    case $mode in
        variants) flags="--quick" ;;                    # the launch variants: accuracy, then speed at rows 1-3
        profile-cython) flags="--profile --cython" ;;   # stage ms and host µs under TileLang's cython launcher
        *) flags="--$mode --quick" ;;
    esac
    timeout "$limit" python benchmarks/hopper_fwd_check.py $flags --out "$OUT"
    echo "hopper_fwd_check $flags: exit $? (limit $limit s)"
done
