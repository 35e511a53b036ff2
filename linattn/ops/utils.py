"""Input checks, varlen helpers and backend selection shared by every linattn operator.

Every public op calls :func:`check_gated_delta_inputs` before doing any work, so a wrong call fails with a
``ValueError``/``TypeError`` that names the argument, what it got and what was expected, instead of a shape error
deep inside a kernel (or, worse, a silently wrong answer).
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

BACKENDS = ("reference", "torch", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
# The floor every path clamps a token's log decay g to where it first reads it: e^g for g ≤ −104 underflows to 0 in
# fp32 (and in every product of decays that includes it), so a gate below the floor — −inf, a full forget, included —
# contributes exactly the zeros it would in exact arithmetic, while the chunk-local sums of gates stay finite (G_i −
# G_j of two −inf sums would be NaN). Finite gates ≥ the floor pass unchanged, bit for bit. dg is 0 below the floor
# (the true derivative, e^g·(…), is 0 there).
MIN_LOG_DECAY = -104.0


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (cached: the answer cannot change within a process, and the ops ask on every call)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_interpret() -> bool:
    """True when Triton kernels run on the CPU through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """Ceil division for host code: ``triton.cdiv`` is a constexpr function whose host call costs ~3 µs."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ≥ n (≥ 1), for host code (``triton.next_power_of_2`` costs ~3 µs per host call)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def select_backend(backend: Optional[str], device: torch.device) -> str:
    """Pick the backend for tensors on ``device``; ``backend`` overrides the default.

    Defaults: ``triton`` on CUDA, ``torch`` everywhere else. ``triton`` on the CPU is allowed only under
    ``TRITON_INTERPRET=1`` (the tests use it); any other impossible request is an error, never a silent fallback.
    """
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package (pip install 'linattn[triton]')")
        if device.type != "cuda" and not triton_interpret():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got {device.type}); on the CPU use backend='torch', "
                "or set TRITON_INTERPRET=1 to run the kernels in the (slow) Triton interpreter")
    return backend


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # a Parameter adds no torch_function/dispatch behaviour


def eager_call(*tensors) -> bool:
    """True when a public op may call its implementation directly instead of through its ``torch.library`` custom op.

    The custom ops exist for tracing (torch.compile, export, fake tensors); an eager call through one pays tens of µs
    of Python dispatch (a mutating op more: docs/performance.md, "Host overhead"). The direct call is taken
    only when nothing can observe the difference: not compiling, no ``__torch_dispatch__`` mode or functorch
    transform active, and every tensor argument a plain ``torch.Tensor`` (not a FakeTensor, DTensor or other
    subclass). ``tensors`` may hold None.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or \
            torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or type(t) in _PLAIN_TENSOR_TYPES for t in tensors)


def eager_autograd_function(fwd_impl, setup_context, backward_fn) -> type:
    """The eager twin of a custom op with registered autograd: an ``autograd.Function`` with the same forward,
    context and backward, without the op's dispatch (see :func:`eager_call`)."""

    class EagerFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.set_materialize_grads(False)
            output = fwd_impl(*inputs)
            setup_context(ctx, inputs, output)
            return output

        backward = staticmethod(backward_fn)

    return EagerFunction


def dispatch_forward(op, fwd_impl, eager_function, inputs: tuple, tensors: tuple):
    """Run a core forward on ``op``'s ``inputs``: through the custom op while tracing (torch.compile, export, fake
    tensors, dispatch modes), directly in eager, through ``eager_function`` when one of ``tensors`` needs a
    gradient. Both routes give identical results (tests/ops/test_host_overhead.py)."""
    if not eager_call(*tensors):
        return op(*inputs)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return eager_function.apply(*inputs)
    return fwd_impl(*inputs)


def _check_tensor(name: str, x, ndim: int, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")


def check_gated_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log=None, dt_bias=None):
    """Validate the arguments of the gated delta rule ops; return ``(scale, N)``, N = number of sequences.

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with ``HV % H == 0``; g, beta ``[B, T, HV]``;
    initial_state ``[N, HV, K, V]``; cu_seqlens ``[N + 1]`` integer, only with ``B == 1``. Only shapes, dtypes
    and devices are checked here (no device sync); :func:`check_cu_seqlens_values` checks the offsets' values.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    _check_tensor("g", g, 3)
    _check_tensor("beta", beta, 3)
    # each .shape / .device read builds a Python object (~0.3 µs): read them once (every op calls this per step)
    q_shape, v_shape = q.shape, v.shape
    B, T, H, K = q_shape
    HV, V = v_shape[2], v_shape[3]
    if k.shape != q_shape:
        raise ValueError(f"k must have the shape of q {tuple(q_shape)} ([B, T, H, K]), got {tuple(k.shape)}")
    if v_shape[0] != B or v_shape[1] != T:
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {B}, {T} as in q, got {tuple(v_shape)}")
    if H == 0 or HV % H != 0:
        raise ValueError(f"the value heads HV={HV} must be a positive multiple of the query/key heads H={H}")
    gate_shape = (B, T, HV)
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != gate_shape:
            raise ValueError(f"{name} must be [B, T, HV] = {gate_shape}, got {tuple(x.shape)}")
    if T == 0 or B == 0:
        raise ValueError(f"q must hold at least one token (B, T = {B}, {T})")
    for name, d in (("K (q/k head dim)", K), ("V (v head dim)", V)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens), ("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and isinstance(x, torch.Tensor) and x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}; all inputs must share one device")

    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 (None for K ** -0.5 = {K ** -0.5:.4g}), got {scale}")

    N = B
    if cu_seqlens is not None:
        check_cu_seqlens_tensor(cu_seqlens)
        if B != 1:
            raise ValueError(f"cu_seqlens (varlen) needs B == 1 with the sequences packed along T, got B={B}")
        N = cu_seqlens.numel() - 1

    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, dtypes=(torch.float32, torch.float64, torch.bfloat16,
                                                                 torch.float16))
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, got "
                             f"{tuple(initial_state.shape)}")

    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None:
            _check_tensor(name, x, 1, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16))
            if x.shape[0] != HV:
                raise ValueError(f"{name} must be [HV] = [{HV}], got {tuple(x.shape)}")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias go together: pass both (gate computed in the op) or neither")
    return scale, N


def check_cu_seqlens_tensor(cu_seqlens) -> None:
    """TypeError / ValueError unless ``cu_seqlens`` is a 1-D int32 or int64 tensor of N + 1 >= 2 offsets (its values
    are :func:`check_cu_seqlens_values`' to check: reading them syncs with the device)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """Check that offsets start at 0, never decrease and end at T; return them as a Python list.

    Reading the values syncs with the device; the ops need them on the host anyway (to plan chunks).
    """
    return check_offsets(cu_seqlens.tolist(), T)


def check_offsets(offs: list[int], T: int) -> list[int]:
    """:func:`check_cu_seqlens_values` on offsets already on the host: at least two, starting at 0, never
    decreasing, ending at T; return them."""
    if len(offs) < 2:
        raise ValueError(f"cu_seqlens must hold N + 1 >= 2 offsets, got {offs}")
    if offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offs[0]}")
    if offs[-1] != T:
        raise ValueError(f"cu_seqlens must end at T={T} (the packed length), got {offs[-1]}")
    if any(b < a for a, b in zip(offs[:-1], offs[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offs}")
    return offs


def host_offsets(cu_seqlens: Optional[torch.Tensor], T: int) -> Optional[list[int]]:
    """``cu_seqlens`` checked and read to the host (:func:`check_cu_seqlens_values`), or None without varlen."""
    return None if cu_seqlens is None else check_cu_seqlens_values(cu_seqlens, T)


def flat_offsets(B: int, T: int) -> list[int]:
    """``[0, T, 2T, …, B·T]``: the token offsets of ``B`` equal-length sequences of ``T`` tokens laid end to end, the
    ``cu_seqlens`` of a ``[B, T, ...]`` batch viewed as ``[1, B·T, ...]``."""
    return [b * T for b in range(B + 1)]


def output_tensor(x: Optional[torch.Tensor], name: str, shape: tuple, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A kernel's output: ``x`` where given (a caller's view to write into; ValueError unless it is a contiguous
    ``dtype`` tensor of ``shape`` on ``device``, which the kernel's layout needs), else a new one."""
    if x is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype or x.device != device or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} {tuple(shape)} on {device}, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}{'' if x.is_contiguous() else ', not contiguous'}")
    return x


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the torch paths' arithmetic and of every state: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x · rsqrt(Σx² + eps) over the last dim, in fp32 (fla's and transformers' convention), back to x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def gate_from_raw(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's decay: g = −exp(A_log) · softplus(g_raw + dt_bias), in fp32 (fp64 for fp64 inputs), at least
    :data:`MIN_LOG_DECAY` (exp(A_log) overflows to inf from A_log ≈ 88.7 in fp32)."""
    dt = torch.float64 if g_raw.dtype == torch.float64 else torch.float32
    a, sp = A_log.to(dt), torch.nn.functional.softplus(g_raw.to(dt) + dt_bias.to(dt))
    floored = (-a.exp() * sp).detach() < MIN_LOG_DECAY        # NaN compares False: it stays NaN
    # floored elements take the floor and no gradient; their exp(A_log) (inf from ≈ 88.7) leaves the graph, since
    # autograd would multiply the zero gradient by it (0 · inf = NaN)
    a = torch.where(floored, 0.0, a)
    return torch.where(floored, MIN_LOG_DECAY, -a.exp() * sp)
