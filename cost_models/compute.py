"""Compute time of one op from its FLOPs and bytes (a roofline), and torch-free FLOP formulas.

The roofline::

    t = max(flops / (peak[dtype] * e_compute), bytes / (bandwidth * e_memory)) + overhead

``e_compute`` is ``device.matmul_efficiency`` for compute-bound families (``COMPUTE_BOUND_FAMILIES``)
and ``OTHER_COMPUTE_EFFICIENCY`` for the rest (no tensor cores, short loops); ``e_memory`` is
``device.memory_efficiency``. A calibrated ``device.op_efficiency[family] = e`` replaces both:
``t = max(flops / peak, bytes / bandwidth) / e + overhead``, i.e. ``e`` is the fraction of the
ideal roofline that the family reaches, which one timing of one op is enough to fit.
"""

from __future__ import annotations

from cost_models.hardware import DeviceSpec

COMPUTE_BOUND_FAMILIES = ("matmul", "attention", "convolution")
OTHER_COMPUTE_EFFICIENCY = 0.3
"""Fraction of peak FLOP/s assumed for families outside COMPUTE_BOUND_FAMILIES (they rarely
bind on compute: pointwise and normalisation ops are memory-bound)."""

_DTYPE_ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8",
}
# When a device has no figure for a dtype, price it as the next dtype here that it has.
_DTYPE_FALLBACK = {
    "float8": ("bfloat16", "float16", "float32"),
    "bfloat16": ("float16", "float32"),
    "float16": ("bfloat16", "float32"),
    "tf32": ("float32",),
    "float64": ("float32",),
}


def normalize_dtype(dtype: str) -> str:
    """Canonical dtype name: "torch.bfloat16" / "bf16" -> "bfloat16", "float8_e4m3fn" -> "float8".

    Integer and bool dtypes map to "float32" (index and mask ops run on the vector units).
    """
    name = dtype.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name.startswith("float8"):
        return "float8"
    if name.startswith(("int", "uint", "bool", "long", "short")):
        return "float32"
    return name


def peak_flops_for(device: DeviceSpec, dtype: str) -> float:
    """The device's dense peak FLOP/s for ``dtype``, falling back to a wider dtype it lists.

    Raises:
        ValueError: no figure for the dtype or any fallback.
    """
    name = normalize_dtype(dtype)
    for candidate in (name, *_DTYPE_FALLBACK.get(name, ())):
        if candidate in device.peak_flops:
            return device.peak_flops[candidate]
    raise ValueError(
        f"device {device.name!r} has no peak FLOP/s for dtype {dtype!r}; "
        f"it lists {sorted(device.peak_flops)}"
    )


def compute_time_s(
    *,
    flops: float,
    bytes_accessed: float,
    device: DeviceSpec,
    dtype: str = "float32",
    family: str | None = None,
) -> float:
    """Seconds one op takes on ``device`` by the roofline in the module docstring.

    Args:
        flops: floating-point operations (a multiply-add is 2).
        bytes_accessed: bytes read plus bytes written in device memory.
        dtype: the compute dtype (selects the peak).
        family: op family ("matmul", "attention", "pointwise", "norm", ...); None = "other".

    Returns:
        Seconds, including ``device.kernel_overhead_s``. An op with no FLOPs and no bytes (a
        view, a metadata op) costs exactly 0: it launches no kernel.
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(f"flops and bytes_accessed must be >= 0, got {flops}, {bytes_accessed}")
    if flops == 0 and bytes_accessed == 0:
        return 0.0
    peak = peak_flops_for(device, dtype)
    calibrated = device.op_efficiency.get(family) if family is not None else None
    if calibrated is not None:
        ideal = max(flops / peak, bytes_accessed / device.mem_bandwidth_Bps)
        return ideal / calibrated + device.kernel_overhead_s
    if family in COMPUTE_BOUND_FAMILIES:
        compute_eff = device.matmul_efficiency
    else:
        compute_eff = OTHER_COMPUTE_EFFICIENCY
    compute_s = flops / (peak * compute_eff)
    memory_s = bytes_accessed / (device.mem_bandwidth_Bps * device.memory_efficiency)
    return max(compute_s, memory_s) + device.kernel_overhead_s


def matmul_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    """FLOPs of ``batch`` products of (m x k) by (k x n): ``2 * batch * m * n * k``."""
    return 2.0 * batch * m * n * k


def _sum_clamped(lo: int, hi: int, cap: int) -> int:
    """sum(min(max(x, 0), cap) for x in range(lo, hi + 1)), in closed form."""
    total = 0
    a, b = max(lo, 1), min(hi, cap)
    if a <= b:
        total += (a + b) * (b - a + 1) // 2
    c = max(lo, cap + 1)
    if c <= hi:
        total += cap * (hi - c + 1)
    return total


def attention_pairs(q_len: int, kv_len: int, *, causal: bool, bottom_right: bool = False) -> int:
    """Number of (query, key) pairs attention computes for one head.

    Causal masks follow ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``:
    query i sees keys ``j <= i`` (top-left aligned). With ``bottom_right=True`` query i sees
    ``j <= i + kv_len - q_len`` (flash-attn >= 2.1, decoding with a KV cache). For
    ``q_len == kv_len`` both give ``q_len * (q_len + 1) / 2``, the lower triangle with the diagonal.
    """
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"sequence lengths must be >= 0, got q_len={q_len}, kv_len={kv_len}")
    if not causal:
        return q_len * kv_len
    offset = kv_len - q_len if bottom_right else 0
    # Row i sees clamp(i + 1 + offset, 0, kv_len) keys.
    return _sum_clamped(1 + offset, q_len + offset, kv_len)


def attention_flops(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    *,
    causal: bool,
    bottom_right: bool = False,
) -> float:
    """Forward FLOPs of scaled dot-product attention: QK^T and PV, 2 FLOPs per multiply-add.

    Non-causal: ``4 * batch * heads * q_len * kv_len * head_dim``. Causal counts only the
    unmasked pairs (see ``attention_pairs``), about half for self-attention. Softmax and scaling
    are O(q_len * kv_len) without the head_dim factor and are left out.
    """
    pairs = attention_pairs(q_len, kv_len, causal=causal, bottom_right=bottom_right)
    return 4.0 * batch * heads * pairs * head_dim


_MEMORY_BOUND_BACKWARD = {
    "pointwise": 1.0,
    "reduction": 1.0,
    "embedding": 1.0,
    "norm": 2.0,
    "softmax": 2.0,
    "view": 0.0,
}


def backward_flops_factor(family: str, num_grad_inputs: int) -> float:
    """Backward FLOPs as a multiple of the op's forward FLOPs.

    - "matmul", "convolution": ``num_grad_inputs`` -- each input that needs a gradient costs one
      product of the forward's size (dX = dY W^T, dW = X^T dY).
    - "attention": 2.5 when any input needs a gradient. A flash-style backward recomputes the
      scores (1 matmul) and computes dV, dP, dQ, dK (4 matmuls): 5 products against the forward's 2.
    - "pointwise", "reduction", "embedding": 1.0 -- the derivative is one elementwise pass of
      about the forward's cost (a reduction's backward is a broadcast; an embedding's a
      scatter-add).
    - "norm", "softmax": 2.0 -- dx needs the forward's normalised output recomputed or read and
      a second reduction (``sum(dy * y)`` for softmax; mean and variance terms for a norm).
    - "view": 0.0 -- metadata only.
    - anything else: 1.0.

    These families are memory-bound, so their bytes matter more than their FLOPs: their backward
    reads the saved input(s) and the output gradient and writes the input gradient, about 1.5x
    the forward's traffic for a unary pointwise op and 2x for a norm or softmax.
    Returns 0.0 when ``num_grad_inputs`` is 0.
    """
    if num_grad_inputs < 0:
        raise ValueError(f"num_grad_inputs must be >= 0, got {num_grad_inputs}")
    if num_grad_inputs == 0:
        return 0.0
    if family in ("matmul", "convolution"):
        return float(num_grad_inputs)
    if family == "attention":
        return 2.5
    return _MEMORY_BOUND_BACKWARD.get(family, 1.0)
