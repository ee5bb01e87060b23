"""Compute time of one op from its FLOPs and bytes (a roofline), and torch-free FLOP formulas.

The roofline::

    t = max(flops / (peak[dtype] * e_compute), bytes / (bandwidth * e_memory)) + overhead

``e_compute`` is ``device.matmul_efficiency`` for compute-bound families (``COMPUTE_BOUND_FAMILIES``)
and ``OTHER_COMPUTE_EFFICIENCY`` for the rest (no tensor cores, short loops); ``e_memory`` is
``device.memory_efficiency``. A calibrated ``device.op_efficiency[family] = e`` (for "activation",
where a profile has none, its "pointwise" figure: ``FAMILY_FALLBACK``) replaces both:
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


FAMILY_FALLBACK = {"activation": "pointwise"}
"""A family a profile calibrated before it existed is priced with this family's figure
("activation": gelu, silu, exp and the like, split from "pointwise": a profile without it timed
them in "pointwise"), so older profiles price every op as they did."""


def _calibrated_efficiency(device: DeviceSpec, family: str | None) -> float | None:
    """``device.op_efficiency`` of ``family``, else of its :data:`FAMILY_FALLBACK`, else None."""
    if family is None:
        return None
    found = device.op_efficiency.get(family)
    if found is None and family in FAMILY_FALLBACK:
        found = device.op_efficiency.get(FAMILY_FALLBACK[family])
    return found


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
    calibrated = _calibrated_efficiency(device, family)
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


# --------------------------------------------------------------------------------------------
# FLOP and byte formulas: the one definition of each, used by the planner (through
# ``autopar.capture.flops``, which maps graph nodes onto these calls) and by the tests. FLOPs count 2 per
# multiply-add; they are the FLOPs the kernels the runtime dispatches to execute (the attention
# backward's recomputed scores included, causal attention without its masked half), which is
# what a roofline needs.


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
    v_head_dim: int | None = None,
    bottom_right: bool = False,
) -> float:
    """Forward FLOPs of scaled dot-product attention: QK^T and PV, 2 FLOPs per multiply-add.

    ``heads`` are query heads (grouped-query K/V heads are broadcast, each query head does its
    own products); ``v_head_dim`` defaults to ``head_dim``. Non-causal:
    ``2 * batch * heads * q_len * kv_len * (head_dim + v_head_dim)``, exactly
    ``torch.utils.flop_counter.sdpa_flop_count``. Causal counts only the unmasked pairs (see
    ``attention_pairs``), about half for self-attention: flash kernels skip the masked blocks
    (FlopCounterMode ignores the mask and counts all pairs). Softmax and scaling are
    O(q_len * kv_len) without the head_dim factor and are left out, as FlopCounterMode does.
    """
    pairs = attention_pairs(q_len, kv_len, causal=causal, bottom_right=bottom_right)
    v_dim = head_dim if v_head_dim is None else v_head_dim
    return 2.0 * batch * heads * pairs * (head_dim + v_dim)


ELEMENTWISE_FLOPS_PER_ELEMENT = {
    "pointwise": 1.0,
    "activation": 1.0,
    "reduction": 1.0,
    "norm": 5.0,
    "softmax": 5.0,
    "loss": 5.0,
}
"""Forward FLOPs per element of the op's largest floating tensor, for families without a
closed form. Conventions, not exact counts (these ops are memory-bound; their bytes decide
their time): a pointwise op or a reduction does one operation per element; softmax five (max,
subtract, exp, sum, divide); a norm about five (mean, centre, square-sum, scale, affine); a
cross-entropy loss five (its log-softmax; the gather of the target is per row)."""


def elementwise_flops(family: str, numel: int) -> float:
    """Forward FLOPs of a ``family`` op whose largest floating tensor has ``numel`` elements;
    0 for families outside ``ELEMENTWISE_FLOPS_PER_ELEMENT`` (views, copies priced as data
    movement only are "pointwise"; embeddings and concatenations move data without FLOPs)."""
    return ELEMENTWISE_FLOPS_PER_ELEMENT.get(family, 0.0) * numel


ATTENTION_BACKWARD_FACTOR = 2.5
"""Attention backward FLOPs over forward FLOPs. The flash / memory-efficient backward (the
kernels SDPA dispatches to on CPU and GPU) recomputes the scores QK^T and computes dP = dO V^T,
dV = P^T dO, dQ = dS K, dK = dS^T Q: five products of the forward's size against its two.
``torch.utils.flop_counter.sdpa_backward_flop_count`` counts the same five."""

_BACKWARD_FACTOR = {
    "pointwise": 1.0,
    "activation": 1.0,
    "reduction": 1.0,
    "embedding": 1.0,
    "loss": 1.0,
    "softmax": 1.0,
    "norm": 2.0,
    "view": 0.0,
}


def backward_flops_factor(family: str, num_grad_inputs: int) -> float:
    """Backward FLOPs as a multiple of the op's forward FLOPs.

    - "matmul", "convolution": ``num_grad_inputs`` -- each matrix operand that needs a gradient
      costs one product of the forward's size (dX = dY W^T, dW = X^T dY); a bias gradient is a
      row sum, negligible (FlopCounterMode counts the same).
    - "attention": ``ATTENTION_BACKWARD_FACTOR`` (2.5) when any input needs a gradient.
    - "norm": 2.0 -- dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dy * w
      recomputes x_hat and takes two row reductions, and dw, db are two more column
      reductions: about 10 FLOPs per element against the forward's 5.
    - "softmax": 1.0 -- dx = y * (dy - sum(dy * y)) is 4 FLOPs per element (log-softmax:
      dx = dy - exp(y) * sum(dy), also 4) against the forward's 5.
    - "pointwise", "activation", "reduction", "embedding", "loss": 1.0 -- one elementwise pass of about the
      forward's cost (a reduction's backward is a broadcast; cross-entropy's is
      softmax - one_hot); an embedding has no forward FLOPs, so its scatter-add is priced by bytes.
    - "view": 0.0 -- metadata only.
    - anything else: 1.0.

    Returns 0.0 when ``num_grad_inputs`` is 0.
    """
    if num_grad_inputs < 0:
        raise ValueError(f"num_grad_inputs must be >= 0, got {num_grad_inputs}")
    if num_grad_inputs == 0:
        return 0.0
    if family in ("matmul", "convolution"):
        return float(num_grad_inputs)
    if family == "attention":
        return ATTENTION_BACKWARD_FACTOR
    return _BACKWARD_FACTOR.get(family, 1.0)


def op_bytes(
    family: str, *, float_input_bytes: float, other_input_bytes: float, output_bytes: float
) -> tuple[float, float]:
    """``(forward, backward)`` bytes one op reads and writes in device memory.

    - "view": (0, 0) -- metadata only.
    - "embedding": a lookup reads the selected rows and writes them (2 x output) and reads the
      indices (``other_input_bytes``), not the table; its backward reads the output gradient,
      scatter-adds it into a dense table gradient that it first zeroes (table + 2 x output).
    - everything else: forward reads every input and writes every output; backward reads the
      saved inputs and the output gradient and writes the input gradients, about twice that.

    The byte counts are for the op that needs a gradient; callers use 0 backward bytes for one
    that does not.
    """
    if family == "view":
        return 0.0, 0.0
    if family == "embedding":
        return other_input_bytes + 2 * output_bytes, float_input_bytes + 2 * output_bytes
    forward = float_input_bytes + other_input_bytes + output_bytes
    return forward, 2 * forward
