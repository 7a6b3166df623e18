"""What the on-device proof proves: each candidate's variants (the ways the quantized dot calls an op) and
the sizes it proves them at."""
from __future__ import annotations

import dataclasses

from fp4jax import random_bits, verdicts
from fp4jax.quantizers import Quantizer


@dataclasses.dataclass(frozen=True)
class Sizes:
  quantize: tuple[int, int]  # (R, C) of the quantize cases and timing (rht_t: (T, C))
  gemm: int                  # M = N = K of the GEMM cases and timing
  iters: int                 # calls per timed run
  tiny: bool = False         # model ops: the tiny case (interpreted kernels) instead of the model's shape


DEVICE_SIZES = Sizes((8192, 8192), 4096, 10)   # the sizes of scripts/gpu_check.py's rows, a GEMM of 4096^3
TINY_SIZES = Sizes((64, 128), 128, 1, tiny=True)   # off a GPU: interpreted kernels (tests, --rehearse)




# ------------------------------------------------------------------------------------------ candidates

@dataclasses.dataclass(frozen=True)
class Variant:
  """One way the quantized dot calls an op: what a verdict for (op, fmt) must cover."""
  op: str
  fmt: str
  name: str
  tiled: bool = False        # quantize: 16x16 tiles; scaled_matmul: (a tiled, b tiled) in ``layout``
  stochastic: bool = False
  sr_bits: str = random_bits.JAX   # stochastic: the layout of the bits the kernel hashes
  scale_rule: str = "rceil"
  layout: tuple[bool, bool] = (False, False)
  pair: tuple[Quantizer, Quantizer] | None = None   # native_gemm: the operands' quantizers


VARIANTS: dict[tuple[str, str], tuple[Variant, ...]] = {
    ("quantize_1d", "nvfp4"): (Variant("quantize_1d", "nvfp4", "1x16"),
                               Variant("quantize_1d", "nvfp4", "1x16 SR", stochastic=True),
                               Variant("quantize_1d", "nvfp4", "1x16 SR packed", stochastic=True, sr_bits="packed"),
                               Variant("quantize_1d", "nvfp4", "1x16 SR philox", stochastic=True, sr_bits="philox")),
    ("quantize_1d", "mxfp4"): (Variant("quantize_1d", "mxfp4", "1x32 rceil"),
                               Variant("quantize_1d", "mxfp4", "1x32 floor", scale_rule="floor"),
                               Variant("quantize_1d", "mxfp4", "1x32 SR", stochastic=True),
                               Variant("quantize_1d", "mxfp4", "1x32 SR packed", stochastic=True, sr_bits="packed"),
                               Variant("quantize_1d", "mxfp4", "1x32 SR philox", stochastic=True, sr_bits="philox")),
    ("quantize_2d", "nvfp4"): (Variant("quantize_2d", "nvfp4", "16x16", tiled=True),
                               Variant("quantize_2d", "nvfp4", "16x16 SR", tiled=True, stochastic=True),
                               Variant("quantize_2d", "nvfp4", "16x16 SR packed", tiled=True, stochastic=True,
                                       sr_bits="packed"),
                               Variant("quantize_2d", "nvfp4", "16x16 SR philox", tiled=True, stochastic=True,
                                       sr_bits="philox")),
    ("quantize_rht_t", "nvfp4"): (Variant("quantize_rht_t", "nvfp4", "rht16 1x16"),
                                  Variant("quantize_rht_t", "nvfp4", "rht16 1x16 SR", stochastic=True),
                                  Variant("quantize_rht_t", "nvfp4", "rht16 1x16 SR packed", stochastic=True,
                                          sr_bits="packed"),
                                  Variant("quantize_rht_t", "nvfp4", "rht16 1x16 SR philox", stochastic=True,
                                          sr_bits="philox")),
    ("quantize_rht_t", "mxfp4"): (Variant("quantize_rht_t", "mxfp4", "rht16 1x32"),
                                  Variant("quantize_rht_t", "mxfp4", "rht16 1x32 SR", stochastic=True),
                                  Variant("quantize_rht_t", "mxfp4", "rht16 1x32 SR packed", stochastic=True,
                                          sr_bits="packed"),
                                  Variant("quantize_rht_t", "mxfp4", "rht16 1x32 SR philox", stochastic=True,
                                          sr_bits="philox")),
    ("scaled_matmul", "nvfp4"): (Variant("scaled_matmul", "nvfp4", "1x16.16x16", layout=(False, True)),
                                 Variant("scaled_matmul", "nvfp4", "1x16.1x16")),
    ("scaled_matmul", "mxfp4"): (Variant("scaled_matmul", "mxfp4", "1x32.1x32"),),
    ("mixed_matmul", "nvfp4"): (Variant("mixed_matmul", "nvfp4", "1x16.16x16", layout=(False, True)),
                                Variant("mixed_matmul", "nvfp4", "1x16.1x16")),
    ("mixed_matmul", "mxfp4"): (Variant("mixed_matmul", "mxfp4", "1x32.1x32"),),
    ("rmsnorm_quantize", "nvfp4"): (Variant("rmsnorm_quantize", "nvfp4", "rmsnorm 1x16"),),
    ("rmsnorm_quantize", "mxfp4"): (Variant("rmsnorm_quantize", "mxfp4", "rmsnorm 1x32 rceil"),),
    ("relu2_quantize", "nvfp4"): (Variant("relu2_quantize", "nvfp4", "relu2 1x16"),),
    ("relu2_quantize", "mxfp4"): (Variant("relu2_quantize", "mxfp4", "relu2 1x32 rceil"),),
    ("native_gemm", "nvfp4"): (
        Variant("native_gemm", "nvfp4", "1x16.16x16", pair=(Quantizer("nvfp4"), Quantizer("nvfp4", tiled=True))),
        Variant("native_gemm", "nvfp4", "1x16.1x16 SR RHT", pair=(
            Quantizer("nvfp4", rht_size=16), Quantizer("nvfp4", stochastic=True, rht_size=16))),
        Variant("native_gemm", "nvfp4", "4/6 1x16.16x16", pair=(
            Quantizer("nvfp4", four_over_six=(256, "mse")),
            Quantizer("nvfp4", tiled=True, four_over_six=(256, "mse"))))),
    ("native_gemm", "nvfp4_eden"): (Variant("native_gemm", "nvfp4_eden", "1x16.1x16", pair=(
        Quantizer("nvfp4_eden"), Quantizer("nvfp4_eden"))),),
    ("native_gemm", "nvfp4_dbq"): (Variant("native_gemm", "nvfp4_dbq", "1x16.1x16", pair=(
        Quantizer("nvfp4_dbq"), Quantizer("nvfp4_dbq", stochastic=True))),),
    ("native_gemm", "mxfp8"): (Variant("native_gemm", "mxfp8", "1x32.1x32", pair=(
        Quantizer("mxfp8"), Quantizer("mxfp8"))),),
    # fp4jax's tcgen05 GEMM (kernels.mosaic_gemm, through fp4jax.native with kernel="mosaic"): fprop/dgrad's
    # pair and wgrad's, the epilogue and the bf16 cast inside the kernel
    ("mosaic_gemm", "nvfp4"): (
        Variant("mosaic_gemm", "nvfp4", "1x16.16x16", pair=(Quantizer("nvfp4"), Quantizer("nvfp4", tiled=True))),
        Variant("mosaic_gemm", "nvfp4", "1x16.1x16 SR RHT", pair=(
            Quantizer("nvfp4", rht_size=16), Quantizer("nvfp4", stochastic=True, rht_size=16)))),
}


GEMM_OPS = ("scaled_matmul", "mixed_matmul", verdicts.NATIVE_OP, verdicts.MOSAIC_OP)
BLACKWELL_OPS = (verdicts.NATIVE_OP, verdicts.MOSAIC_OP)   # proved only on compute capability 10.x


