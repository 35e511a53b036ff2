#!/usr/bin/env bash
# The Hopper forward's pieces built and tested on a CPU but not yet run on a GPU, checked in one device call
# (docs/performance.md, "Next GPU session"): the TileLang pre-pass, the role-split kernel, the segmented forward at
# a slow decay. Each in its own process under a time limit (a wrong mbarrier hangs the role-split kernel), so one
# failure does not stop the others; JSON results under $OUT, the tables on stdout. Needs .anchors/ (TileLang 0.1.15
# in the anchors' site packages; fla is removed from the copy: its import and autotune are not needed here).
#
#     bash benchmarks/hopper_pending_checks.sh            # ≈ 6–8 min with the compiles
set -u
OUT=${OUT:-.}
mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz && rm -rf /tmp/site/fla || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
for mode in prepass roles segmented; do
    timeout 240 python benchmarks/hopper_fwd_check.py --$mode --quick --out "$OUT"
    echo "hopper_fwd_check --$mode --quick: exit $?"
done
