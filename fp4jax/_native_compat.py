"""Every jax-version-specific piece of the native block-scaled GEMM (``fp4jax.native``), in one place.

Written against jax 0.10.2, whose ``jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales,
preferred_element_type)`` takes lhs (B, M, K) and rhs (B, N, K), both contracted over their last axis
K with B a batch axis, and scales (B, M, K/blk), (B, N, K/blk) laid out like the operands (row-major;
XLA inserts the swizzle to the tensor cores' scale layout itself). Its CUDA lowering is the custom
call ``__op$block_scaled_dot``, which XLA compiles for sm_100 into ``__cudnn$blockScaledDot`` (cuDNN's
block-scaled GEMM) when the operands are float4_e2m1fn with float8_e4m3fn scales per 16 (NVFP4) or
float8 with float8_e8m0fnu scales per 32 (MXFP8). Measured on this jax with deviceless sm_100
compiles: float4_e2m1fn with float8_e8m0fnu scales per 32 (MXFP4) is *not* taken; XLA rewrites it to a
float32 dequantize and a float32 cuBLASLt GEMM. There is no CPU lowering (NotImplementedError at
lowering).

The GPU image runs jax 0.11.2; jax's current documentation gives ``jax.nn.scaled_matmul`` the same
signature and the same cuDNN operand rules. Not yet run on a device: scripts/gpu_check.py's native
rows are that check.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import target

# The optimized-HLO custom call of a block-scaled GEMM on Blackwell (what the compile tests count).
BLOCK_SCALED_TARGET = "__cudnn$blockScaledDot"
# What jax lowers scaled_matmul to before XLA's GPU passes (the StableHLO / unoptimized HLO).
BLOCK_SCALED_OP = "__op$block_scaled_dot"


def has_block_scaled_matmul() -> bool:
  """Whether this jax has ``jax.nn.scaled_matmul`` and the float4_e2m1fn dtype."""
  return hasattr(jax.nn, "scaled_matmul") and hasattr(jnp, "float4_e2m1fn")


def to_float4(codes_u8):
  """E2M1 codes (uint8 in 0..15, the standard sign-exponent-mantissa bits) as float4_e2m1fn, bit for
  bit (the two encodings are the same four bits)."""
  return lax.bitcast_convert_type(codes_u8.astype(jnp.uint4), jnp.float4_e2m1fn)


def packed_float4(packed_u8):
  """Packed E2M1 codes (uint8 (..., C/2), element 2i in the low nibble of byte i: ``e2m1.pack``) as
  float4_e2m1fn (..., C), bit for bit, by bitcasts alone: XLA's 4-bit arrays hold element 2i in the low nibble
  too, so on a GPU the operand is the packed buffer itself, where ``to_float4`` of the unpacked codes is a
  pass that reads the codes and writes them again.

  The barrier keeps XLA from evaluating the bitcast at compile time: its constant folder (HloEvaluator, the CPU's
  and the GPU's) holds a 4-bit array one element per byte and folds a uint8 -> uint4 bitcast of constant codes
  into other values (jax 0.10.2: bytes 0x21 0x43 fold to nibbles 1 3 instead of 1 2 3 4). On a computed
  operand the barrier changes nothing."""
  nibbles = lax.bitcast_convert_type(lax.optimization_barrier(packed_u8), jnp.uint4)   # (..., C/2, 2), low first
  return lax.bitcast_convert_type(nibbles.reshape(*packed_u8.shape[:-1], -1), jnp.float4_e2m1fn)


def block_scaled_matmul(a, b, a_scales, b_scales):
  """float32 (M, N) = Σ_k a[m, k]·a_scales[m, k/blk] · b[n, k]·b_scales[n, k/blk] on the hardware's
  block-scaled GEMM: NVFP4, a (M, K), b (N, K) float4_e2m1fn with float8_e4m3fn scales (M, K/16), (N, K/16);
  or MXFP8, float8_e4m3fn with float8_e8m0fnu scales (M, K/32), (N, K/32)."""
  return batched_block_scaled_matmul(a[None], b[None], a_scales[None], b_scales[None])[0]


def batched_block_scaled_matmul(a, b, a_scales, b_scales):
  """float32 (B, M, N): ``block_scaled_matmul`` of each pair along the batch axis B (one batched
  block-scaled GEMM): a (B, M, K), b (B, N, K), scales (B, M, K/blk), (B, N, K/blk).

  Inside ``shard_map``, jax 0.10.2's ``scaled_matmul`` types its result as varying over no mesh axis whatever
  its operands vary over (its twin's ``dot_general`` keeps their axes, and ``lax.platform_dependent`` refuses
  branches of different types: "the manual axis types do not match", the expert-parallel MoE step on sm_100):
  the result is cast to vary over every axis an operand varies over."""
  out = jax.nn.scaled_matmul(a, b, a_scales, b_scales, preferred_element_type=jnp.float32)
  return vary_like(out, a, b, a_scales, b_scales)


def vary_like(x, *like):
  """``x`` cast to vary over every ``shard_map`` mesh axis that a leaf of ``like`` varies over (``x`` itself
  outside one): for a value made of none of them, such as a loop's zero initial carry, whose type must match
  what the loop computes from them."""
  missing = frozenset().union(*map(varying_axes, jax.tree.leaves(like))) - varying_axes(x)
  return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def varying_axes(x) -> frozenset:
  """The ``shard_map`` mesh axes ``x`` varies over (empty outside one): jax 0.10.2 names them
  ``typeof(x).manual_axis_type.varying``, earlier and later jax ``typeof(x).vma``."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    mat = getattr(aval, "manual_axis_type", None)
    vma = mat.varying if mat is not None else ()
  return frozenset(vma)


def cuda_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of this process's default device when it is a CUDA GPU, else None.

  A deviceless compile (platforms cpu,cuda without a GPU) has CPU devices here: None. The automatic
  choices read the program's devices instead (``fp4jax.target``)."""
  return target.Target.here().capability


@functools.lru_cache(maxsize=None)
def cpu_lowering_exists() -> bool:
  """Whether ``jax.nn.scaled_matmul`` lowers for the CPU in this jax (0.10.2: no)."""
  if not has_block_scaled_matmul():
    return False
  a = jax.ShapeDtypeStruct((16, 16), jnp.float4_e2m1fn)
  s = jax.ShapeDtypeStruct((16, 1), jnp.float8_e4m3fn)
  try:
    jax.jit(block_scaled_matmul).trace(a, a, s, s).lower(lowering_platforms=("cpu",))
  except NotImplementedError:
    return False
  return True
