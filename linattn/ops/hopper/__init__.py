"""The sm_90 (Hopper) forward in TileLang, an optional dependency; ``gated_delta/dispatch.py`` asks
``plan.plan_inputs`` whether it runs a call and runs it through ``forward.forward_hopper``:

    plan.py           whether and how it runs (launch, segments): the few tunables, typed (HopperPlanConfig)
    prepass.py        gc, β head-major and each chunk's inverse A_inv (bf16), and the chunks' map bounds
    chunk_fwd.py      the fused walk: the state on chip, o and the final state written (plain, affine, warm)
    walk_launch.py    its launchers: the compiled kernel for a launch's options, tensors checked, o allocated
    chunk_fwd_ref.py  the walk's PyTorch twins
    map_bound.py      the map bound's chunk sums and the segment plan (Triton)
    forward.py        the pre-pass and the (segmented) walks for a plan
    prepared.py       a repeated signature's launches without forward.py's checks and plan, its scratch kept
    route.py          the public op's repeated calls sent straight to their prepared forward
    varlen.py         packed sequences (cu_seqlens) padded to one length around forward.py
"""
