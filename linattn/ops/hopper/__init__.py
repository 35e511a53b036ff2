"""The sm_90 (Hopper) forward in TileLang, an optional dependency; ``chunk_gated_delta_rule``'s "auto" path takes it
on sm_90 for the bf16 inputs it supports (``triton_chunk.hopper_plan``), the Triton paths elsewhere (issue 4):

    prepass.py        gc, β head-major and each chunk's inverse A_inv (bf16), and the chunks' map bounds
    chunk_fwd.py      the fused walk: the state on chip, o and the final state written (plain, affine, warm)
    walk_launch.py    its launchers: the compiled kernel for a launch's options, tensors checked, o allocated
    chunk_fwd_ref.py  the walk's PyTorch twins
    uniform_warpgroup.py  the walk's generated CUDA with a warp-uniform warpgroup index (on)
    chunk_fwd_roles.py  an experimental role-split walk (off)
    map_bound.py      the map bound's chunk sums and the segment plan (Triton)
    forward.py        the launch plan and the (segmented) forward that chains them
    prepared.py       a repeated signature's launches without forward.py's checks and plan (on), its scratch
                      kept from call to call (REUSE_SCRATCH, on since run 33)
    varlen.py         packed sequences (cu_seqlens) by padding them to one length around forward.py
"""
