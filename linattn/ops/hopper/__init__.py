"""The sm_90 (Hopper) forward and backward in TileLang, an optional dependency. ``gated_delta/dispatch.py`` asks
``plan.plan_inputs`` whether the forward runs a call and runs it through ``forward.forward_hopper``; it asks
``compile.unsupported_reason`` and ``backward.size_limit`` / ``dtype_limit`` whether the backward does, and runs it
through ``backward.chunk_gated_delta_rule_bwd_hopper``.

The forward:

    plan.py           whether and how it runs (launch, segments): the few tunables, typed (HopperPlanConfig)
    prepass.py        gc, β head-major and each chunk's inverse A_inv (bf16), and the chunks' map bounds
    chunk_fwd.py      the fused walk: the state on chip, o and the final state written (plain, affine, warm)
    walk_launch.py    its launchers: the compiled kernel for a launch's options, tensors checked, o allocated
    chunk_fwd_ref.py  the walk's PyTorch twins
    map_bound.py      the map bound's chunk sums and the segment plan (Triton)
    forward.py        the pre-pass and the (segmented) walks for a plan
    prepared.py       a repeated signature's launches without forward.py's checks and plan, its scratch kept
    route.py          the public op's repeated calls sent straight to their prepared forward
    varlen.py         packed sequences (cu_seqlens) padded to one length around forward.py and backward.py

The backward (the design: docs/backward.md):

    backward.py       the host chain: recompute on the forward's kernels, segments, the reverse walk, reductions
    segments.py       the reverse walk in segments: where to cut, and the gradient of the state leaving each
    chunk_bwd.py      the fused reverse walk, and the reverse warm-ups
    chunk_bwd_ref.py  their PyTorch twins

Beside them: compile.py (compiling, whether the Hopper kernels can take an input, a failed compile remembered),
cubin.py (a kernel's CUDA compiled for sm_90a without a GPU, for the tests' ptxas checks), uniform_warpgroup.py (the
forward walk's warpgroup index made warp-uniform in its generated CUDA).
"""
