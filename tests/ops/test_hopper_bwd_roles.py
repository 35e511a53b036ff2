"""The role-split reverse walk (linattn/ops/hopper/chunk_bwd_roles.py) on the CPU: its build for sm_90a at K = V = 64
and 128 (four warpgroups each at its own register budget, the chunk's tiles within a CTA's shared memory, every dot on
wgmma, the hand-offs on mbarriers) and its argument checks. Its numbers on the GPU: benchmarks/gpu_check_roles_walk.py
(K = V = 128, against the slice walk and, through the op, float64). Its twin is the slice walk's
(``chunk_bwd_ref.reverse_walk_ref``): the same operations and rounding points on the whole V."""
from __future__ import annotations

import re
import shutil

import pytest
import torch

from linattn.ops.hopper import chunk_bwd_roles, chunk_fwd

COMPILES = pytest.mark.skipif(not chunk_fwd.tilelang_available() or shutil.which("nvcc") is None,
                              reason="TileLang (optional) and nvcc compile the Hopper kernels")
CTA_SHARED = 227 * 1024
# Measured at REGISTERS = (160, 168, 160, 24), K = V = 128: each role alone spills nothing at its budget; together
# ptxas spills 20 B (values formed before the role branch live into every role). The next step is to remove it,
# not to grow it. K = V = 64 (a quarter of S's state registers, half of B's fragments) spills nothing.
SPILL_BYTES = {128: 20, 64: 0}
# shared memory (bytes) of the launch: the tiles of alloc_tiles at K = V (each on a 1 KB boundary)
SHARED_BYTES = {128: 231424, 64: 133120}
# dots per chunk: S 3 (Qᵀ Gh, Qᵀ Gl, C3), B 14 (C1 ×2, K S ×2, T X, Pᵀ dO, Tᵀ dV_new, V_new dS_hiᵀ, dk's four,
# dO hᵀ, dP K), A 4 (Q Kᵀ, dO V_newᵀ, Y V_newᵀ, K Kᵀ; its column sums read the products from shared memory):
# 21 dots per chunk
ROLE_DOTS = {"S": 3, "B": 14, "A": 4}
DOTS = sum(ROLE_DOTS.values())


BUILDS = [(16, 16, 128, True), (2, 8, 128, False), (16, 16, 64, True), (2, 8, 64, False)]


@COMPILES
@pytest.mark.parametrize("H,HV,K,state_grads", BUILDS,
                         ids=["H16", "gva_no_state_grads", "K64_H16", "K64_gva_no_state_grads"])
def test_role_split_walk_compiles_for_sm90a(tmp_path, H, HV, K, state_grads):
    """At each of ``chunk_bwd_roles.SIZES``: every dot on wgmma, each role's register budget, no CTA-wide barrier in
    a role, whole-warp elects, the launch's shared memory as planned, no barrier in an element loop, the spill
    within its bound."""
    from linattn.ops.hopper.cubin import barriers_in_element_loops, compile_sm90a, launch_shared_bytes, ptxas_summary
    kernel = chunk_bwd_roles.compiled_kernel(H, HV, K, K, K ** -0.5, "sm_90a", state_grads)
    source = kernel.get_kernel_source()
    assert source.count("tl::wgmma_ss<tl::DataType::kBFloat16") == DOTS and "mma_sync" not in source
    for registers in chunk_bwd_roles.REGISTERS[:3]:
        assert f"tl::warpgroup_reg_alloc<{registers}>();" in source, registers
    assert f"tl::warpgroup_reg_dealloc<{chunk_bwd_roles.REGISTERS[3]}>();" in source
    assert sum(chunk_bwd_roles.REGISTERS) * 128 == 65536      # the register file at 512 threads
    assert "__syncthreads();" not in source.split("tl::fence_barrier_init();")[1].split("warpgroup_reg_alloc")[1], \
        "a CTA-wide barrier inside a role would deadlock the others"
    # elect.sync (TileLang's copy issue) names the whole warp: under a branch of fewer lanes it hangs
    elects = [int(n) for n in re.findall(r"tl_shuffle_elect<(\d+)>", source)]
    assert elects and all(n == 0 or n % 32 == 0 for n in elects), elects
    assert ("dh0" in source) == state_grads
    dk_stored = "bfloat16_t* __restrict__ dk" if H == HV else "float* __restrict__ dk"   # chunk_bwd.qk_heads_dtypes
    assert "bfloat16_t* __restrict__ dq" in source and dk_stored in source, dk_stored
    assert launch_shared_bytes(kernel) == SHARED_BYTES[K] <= CTA_SHARED, launch_shared_bytes(kernel)
    assert not barriers_in_element_loops(source), "a pass that reads and writes shared memory: split it (B's X, Y)"
    ptxas = ptxas_summary(compile_sm90a(source, tmp_path)[1])
    assert ptxas["spill_stores"] <= SPILL_BYTES[K] and not ptxas["wgmma_serialised"], ptxas


@COMPILES
@pytest.mark.parametrize("H,K,want_dh0", [(4, 128, True), (2, 128, False), (2, 64, False)],
                         ids=["H4", "gva_no_state_grads", "K64_gva_no_state_grads"])
def test_role_split_walk_launch_matches_the_kernels_parameters(monkeypatch, H, K, want_dh0):
    """chunk_bwd_roles_hopper's tensors (CPU stand-ins; the launch recorded, not run) against the compiled walk's
    parameters, which the launch checks on the GPU: every dtype and shape (one value per symbolic size); dg and dβ
    the one slice's rows of the [1, B, HV, Lp] outputs the backward's sums take; dv written in place."""
    from .test_hopper_bwd import assert_launch_matches_params
    compiled = chunk_bwd_roles.compiled_kernel(H, 4, K, K, K ** -0.5, "sm_90a", want_dh0)
    launched = []
    monkeypatch.setattr(chunk_bwd_roles, "compiled_kernel", lambda *args, **kw: compiled)
    monkeypatch.setattr(chunk_bwd_roles, "launcher", lambda kernel: lambda *args: launched.extend(args))
    B, T, NT = 2, 100, 2
    bf = torch.bfloat16
    q, k = (torch.zeros(B, T, H, K, dtype=bf) for _ in range(2))
    v, do = (torch.zeros(B, T, 4, K, dtype=bf) for _ in range(2))
    gc, beta = (torch.zeros(B, 4, NT * 64) for _ in range(2))
    dv = torch.empty(B, T, 4, K, dtype=bf)
    out = chunk_bwd_roles.chunk_bwd_roles_hopper(q, k, v, do, gc, beta, torch.zeros(B, T, 4, 64, dtype=bf),
                                                 torch.zeros(B, NT, 4, K, K, dtype=bf), None, K ** -0.5,
                                                 want_dh0=want_dh0, dv=dv)
    assert len(launched) == len(compiled.params)
    assert_launch_matches_params(launched, compiled.params)
    assert out[2] is dv is launched[11] and out[3].shape == (1, B, 4, NT * 64)
    assert launched[12].data_ptr() == out[3].data_ptr() and launched[13].data_ptr() == out[4].data_ptr()
    assert (out[5] is None) != want_dh0


def test_role_split_walk_is_built_for_k_equal_to_v_in_its_sizes_only():
    assert chunk_bwd_roles.SIZES == (64, 128)
    for K, V in ((128, 64), (64, 128), (96, 96), (32, 32)):
        with pytest.raises(ValueError, match="K = V in"):
            chunk_bwd_roles.build_kernel(2, 2, K, V, 0.125)


def test_role_split_walk_checks_its_layouts():
    B, T, H, K = 1, 100, 2, 128
    q = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    v = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    gc = torch.zeros(B, H, 128)
    a_inv = torch.zeros(B, T, H, 64, dtype=torch.bfloat16)
    h = torch.zeros(B, 2, H, K, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gc and beta"):
        chunk_bwd_roles.chunk_bwd_roles_hopper(q, q, v, v, gc[..., :64], gc, a_inv, h, None, 0.1)
    with pytest.raises(ValueError, match="h must be bf16"):
        chunk_bwd_roles.chunk_bwd_roles_hopper(q, q, v, v, gc, gc, a_inv, h.float(), None, 0.1)


@COMPILES
@pytest.mark.parametrize("busy", ["S", "B", "A"])
def test_timeline_builds_with_idle_roles_compile_for_sm90a(busy):
    """The timeline build with one role busy (``busy``: the others hand off alone) for sm_90a: the busy role's dots
    alone, all on wgmma, one CTA an SM as the walk (TileLang drops the tiles no busy role touches, so its shared
    memory may be less; the 512 threads at their registers fill the register file either way)."""
    from linattn.ops.hopper.cubin import launch_shared_bytes
    kernel = chunk_bwd_roles.compiled_kernel(16, 16, 128, 128, 128 ** -0.5, "sm_90a", False, True, busy)
    source = kernel.get_kernel_source()
    assert source.count("tl::wgmma_ss<tl::DataType::kBFloat16") == ROLE_DOTS[busy] and "mma_sync" not in source
    assert launch_shared_bytes(kernel) <= SHARED_BYTES[128], launch_shared_bytes(kernel)
    assert "__launch_bounds__(512, 1)" in source


def test_idle_roles_only_in_the_timeline_build():
    """``busy`` leaves roles idle only in the instrument (the walk itself always has every role), and names roles
    of "SBA" only."""
    for busy, timeline in [("SB", False), ("", True), ("SX", True)]:
        with pytest.raises(ValueError, match="busy must be"):
            chunk_bwd_roles.build_kernel(2, 4, 64, 64, 0.125, False, timeline, busy)


def test_hand_offs_order_every_shared_access_and_never_deadlock():
    """The roles' events as the kernel's source writes them (tests/ops/roles_protocol.py), over three chunks in 200
    random interleavings: every wait finds its phase (no deadlock, no wait two phases behind), every pair of
    accesses of a shared tile by two roles with a write among them is ordered by the hand-offs (the TMA's writes
    included), and every generic write that a wgmma reads has a proxy fence before it is handed on."""
    from . import roles_protocol
    for seed in range(200):
        ran = roles_protocol.simulate(chunks=3, seed=seed)
    assert ran["phases"]["end"] == 3 and ran["phases"]["init"] == 1, ran


@pytest.mark.parametrize("busy", ["S", "B", "A", "SB", "BA"])
def test_timeline_builds_with_idle_roles_never_deadlock(busy):
    """The timeline build's idle roles (``build_kernel(busy=...)``: a role's hand-offs alone) beside the busy ones
    in the same model: every wait finds its phase, and each chunk ends (the busy roles' accesses stay ordered: the
    idle ones touch no tile)."""
    from . import roles_protocol
    for seed in range(50):
        ran = roles_protocol.simulate(chunks=3, seed=seed, busy=busy)
    assert ran["phases"]["end"] == 3 and ran["phases"]["init"] == 1, ran


MUTATIONS = [("value_side", "wait", "free_g", "not ordered"), ("chain", "wait", "read_ds", "dSh"),
             ("key_side", "wait", "read_p", "PdP"), ("key_side", "fence", "", "proxy fence"),
             ("value_side", "arrive", "ready_xt", "deadlock"), ("value_side", "wait", "read_vec", "vec.TS"),
             ("chain", "wait", "read_sums", "dSl"), ("key_side", "wait", "read_v", "Vs")]


@pytest.mark.parametrize("role,kind,barrier,found", MUTATIONS, ids=[f"{m[0]}_{m[1]}_{m[2]}" for m in MUTATIONS])
def test_the_protocol_model_finds_a_missing_hand_off(monkeypatch, role, kind, barrier, found):
    """The model fails where one wait, arrive or fence of a role is removed from its chunk loop."""
    from . import roles_protocol
    events = roles_protocol.role_events()

    def without_one(busy="SBA"):
        changed = dict(events)
        loop = next(item for item in changed[role] if isinstance(item, tuple))
        body = list(loop[1])
        del body[next(i for i, e in enumerate(body) if e.kind == kind and e.barrier == barrier)]
        changed[role] = [("loop", body) if item is loop else item for item in changed[role]]
        return changed

    monkeypatch.setattr(roles_protocol, "role_events", without_one)
    errors = []
    for seed in range(100):
        try:
            roles_protocol.simulate(chunks=3, seed=seed)
        except roles_protocol.ProtocolError as e:
            errors.append(str(e))
    assert errors and any(found in e for e in errors), errors[:3]


def test_barriers_in_element_loops_finds_a_barrier_inside_an_unrolled_loop_only():
    from linattn.ops.hopper.cubin import barriers_in_element_loops
    source = "\n".join([
        "  tl::__sync_thread_partial(4, 128);",          # 1: outside any loop
        "  for (int step = 0; step < n; ++step) {",      # 2: the chunk loop (not unrolled)
        "    tl::__sync_thread_partial(4, 128);",        # 3: in the chunk loop only
        "    #pragma unroll",
        "    for (int i_9 = 0; i_9 < 32; ++i_9) {",
        "      float x = a[i_9];",
        "      tl::__sync_thread_partial(4, 128);",      # 7: inside the element loop
        "      b[i_9] = x;",
        "    }",
        "    tl::__sync_thread_partial(4, 128);",        # 10: after it
        "  }"])
    assert barriers_in_element_loops(source) == [7]


def test_the_dg_warp_scan_forms_the_cumsums():
    """The walk's dg finish by warp scans (``chunk_bwd_ref.warp_scan_dg_ref``, its transcription) against the same
    sums formed directly (``_decay_gradient``'s: the reverse cumsum of dG, the exclusive cumsum of t, the tail), in
    float64 over random chunks: within 1e-14 of the largest term. On the GPU ``walk_ab.py --roles`` compares the
    walk's dg with the direct sums' build (within 3e-7 relative, docs/decisions.md)."""
    from linattn.ops.gated_delta import torch_chunk as tc
    from linattn.ops.hopper.chunk_bwd_ref import warp_scan_dg_ref
    gen = torch.Generator().manual_seed(0)
    dG, t = (torch.randn(5, 64, generator=gen, dtype=torch.float64) * 10 ** torch.arange(5.0)[:, None]
             for _ in range(2))
    tail = torch.randn(5, generator=gen, dtype=torch.float64)
    direct = tc.chunk_local_cumsum_bwd_ref(dG) + torch.nn.functional.pad(t.cumsum(-1)[..., :-1], (1, 0)) + tail[:, None]
    scanned = warp_scan_dg_ref(dG, t, tail)
    scale = dG.abs().amax(-1, keepdim=True) + t.abs().amax(-1, keepdim=True)
    assert ((scanned - direct).abs() / scale).max() < 1e-14
    # the comparison sees one row out of place: dG shifted by a row gives other sums
    assert ((warp_scan_dg_ref(dG.roll(1, -1), t, tail) - direct).abs() / scale).max() > 1e-3

