#!/usr/bin/env bash
# The Hopper forward's pieces built and tested on a CPU but not yet run on a GPU (docs/performance.md, "Next GPU
# session"): the TileLang pre-pass, the role-split kernel, the segmented forward at a slow decay. Each mode runs
# `hopper_fwd_check.py --<mode> --quick` in its own process under a time limit (a wrong mbarrier hangs the
# role-split kernel), so one failure does not stop the others; JSON results under $OUT, the tables on stdout. Needs
# .anchors/ (TileLang 0.1.15 in the anchors' site packages; fla is left out of the copy: not needed here).
#
#     bash benchmarks/hopper_pending_checks.sh prepass segmented     # ≈ 4–5 min with the compiles
#     bash benchmarks/hopper_pending_checks.sh roles                 # ≈ 4–5 min: a call of its own (600 s limit)
set -u
OUT=${OUT:-.}
modes=${*:-prepass segmented roles}
mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz && rm -rf /tmp/site/fla || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
for mode in $modes; do
    limit=$([ "$mode" = roles ] && echo 420 || echo 240)
    timeout "$limit" python benchmarks/hopper_fwd_check.py --"$mode" --quick --out "$OUT"
    echo "hopper_fwd_check --$mode --quick: exit $? (limit $limit s)"
done
