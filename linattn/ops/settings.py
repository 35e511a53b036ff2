"""The Triton path's (and the Hopper forward's) tunable settings in one dict, for reports: ``linattn eval`` records
them beside the environment so a report says which forward path, loop stages, launch widths and precisions produced
its numbers (they are module settings the benchmarks flip, docs/performance.md)."""
from __future__ import annotations

import importlib.util
from typing import Optional


def triton_settings() -> Optional[dict]:
    """The chunked op's Triton settings as plain values, or None where Triton is not importable."""
    try:
        from . import common
        from .common import (
            fused_fwd,
            fused_prepass,
            kkt_solve,
            launch,
            local_bwd_wy,
            split_fwd,
            state_pass,
            state_pass_bwd,
        )
        from .common.local_bwd_utils import BWD_WARPS
        from .gated_delta import recurrent_kernels, triton_bwd, triton_chunk
        from .hopper import chunk_fwd as hopper_kernel
        from .hopper import forward as hopper
        from .hopper import prepass as hopper_prepass
        from .hopper import varlen as hopper_varlen
    except ImportError:
        return None
    return {
        "FORWARD_PATH": triton_chunk.FORWARD_PATH,
        "WALK_MIN_PAIRS": {str(d).removeprefix("torch."): n for d, n in triton_chunk.WALK_MIN_PAIRS.items()},
        "PRECOMPUTE_QK": triton_chunk.PRECOMPUTE_QK,
        "WALK_STAGES": fused_fwd.WALK_STAGES, "STATE_PASS_STAGES": state_pass.STATE_PASS_STAGES,
        "BWD_STAGES": state_pass_bwd.BWD_STAGES, "STATE_PASS_WARPS": state_pass.STATE_PASS_WARPS,
        "PREPASS_WARPS": fused_prepass.PREPASS_WARPS, "BWD_WARPS": dict(BWD_WARPS),
        "INVERSE_DOT_PREC": local_bwd_wy.INVERSE_DOT_PREC,
        "MERGE_PREC_BF16": kkt_solve.MERGE_PREC_BF16, "SPLIT_OUTPUT_PREC_BF16": split_fwd.OUTPUT_PREC_BF16,
        "SPLIT_STORE_BF16": split_fwd.STORE_BF16, "SPLIT_WU_STORE_BF16": split_fwd.WU_STORE_BF16,
        "SPLIT_WY_FORM": split_fwd.WY_FORM, "WY_IN_STATE_PASS_MIN_PAIRS": split_fwd.WY_IN_STATE_PASS_MIN_PAIRS,
        "A_INV_MIN_FILL": state_pass.A_INV_MIN_FILL,
        "BWD_RECOMPUTE_STORE_BF16": triton_bwd.RECOMPUTE_STORE_BF16, "BWD_DH_STORE_BF16": triton_bwd.DH_STORE_BF16,
        "FP32_DOT_PRECISION": common.FP32_DOT_PRECISION, "FP32_PRODUCT_PRECISION": common.FP32_PRODUCT_PRECISION,
        "DECODE_ONE_STEP": recurrent_kernels.DECODE_ONE_STEP,
        "LAUNCH_OPTIONS": {k: dict(v) for k, v in common.LAUNCH_OPTIONS.items()},
        "FAST_LAUNCH": launch.FAST_LAUNCH,
        # the Hopper forward (TileLang, optional): whether it can run here at all, and what "auto" would make of it
        "HOPPER": {
            "tilelang_installed": importlib.util.find_spec("tilelang") is not None,   # found, not imported
            "compile_failed": hopper_kernel.COMPILE_FAILED,
            "LAUNCH": dict(hopper.LAUNCH), "A_INV_DTYPE": str(hopper.A_INV_DTYPE).removeprefix("torch."),
            "FILL_FRACTION": hopper.FILL_FRACTION, "SEGMENTED_AUTO": hopper.SEGMENTED_AUTO,
            "MIN_SEGMENTED_HEAD_TOKENS": hopper.MIN_SEGMENTED_HEAD_TOKENS, "SMALL_SEGMENTED": hopper.SMALL_SEGMENTED,
            "SEGMENTED_WHEN_CAPTURED": hopper.SEGMENTED_WHEN_CAPTURED, "SMALL_PLAN_IN_WALK": hopper.SMALL_PLAN_IN_WALK,
            "TWO_PER_SM": hopper.TWO_PER_SM, "LEAN_SEGMENTS": hopper.LEAN_SEGMENTS,
            "MIN_SEGMENT_CHUNKS": hopper.MIN_SEGMENT_CHUNKS, "SCAN_BV": hopper.SCAN_BV, "PREPASS": hopper.PREPASS,
            "SKIP_NEGLIGIBLE_MAPS": hopper.SKIP_NEGLIGIBLE_MAPS, "WARM_UP": hopper.WARM_UP,
            "WARM_UP_MAX_FRACTION": hopper.WARM_UP_MAX_FRACTION, "NEGLIGIBLE_M_LOG2": hopper.NEGLIGIBLE_M_LOG2,
            "MAP_WAVE_FILL": hopper.MAP_WAVE_FILL, "OVERLAP_WARM": hopper.OVERLAP_WARM,
            "EXECUTION_BACKEND": hopper_kernel.EXECUTION_BACKEND, "BETA_IN_A_INV": hopper_prepass.BETA_IN_A_INV,
            "PREPASS_MIN_BLOCKS_PER_SM": hopper_prepass.MIN_BLOCKS_PER_SM, "PREPASS_TMA_KEYS": hopper_prepass.TMA_KEYS,
            "PREPASS_A_ROW_PAD": hopper_prepass.A_ROW_PAD, "PREPASS_T_ROW_PAD": hopper_prepass.T_ROW_PAD,
            "PREPASS_STEP4_BLOCKED": hopper_prepass.STEP4_BLOCKED,
            "DIRECT_LAUNCH": hopper_kernel.DIRECT_LAUNCH, "ASYNC_O_STORE": hopper_kernel.ASYNC_O_STORE,
            "ASYNC_AX": hopper_kernel.ASYNC_AX, "DEFERRED_DECAY": hopper_kernel.DEFERRED_DECAY,
            "DEFERRED_DECAY_LIMIT": hopper_kernel.DEFERRED_DECAY_LIMIT, "FOLD_P_DECAY": hopper_kernel.FOLD_P_DECAY,
            "UNIFORM_WARPGROUP": hopper_kernel.UNIFORM_WARPGROUP,
            "STATE_ONLY_WARMUPS": hopper_kernel.STATE_ONLY_WARMUPS,
            "VARLEN_BY_PADDING": hopper_varlen.VARLEN_BY_PADDING,
            "VARLEN_MAX_PADDED_FRACTION": hopper_varlen.MAX_PADDED_FRACTION,
        },
    }
