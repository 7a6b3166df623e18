"""The numerics of each format, one idea a module, on plain arrays (no QTensor, no primitives):

  e2m1 scales                 E2M1 codes (nearest even, stochastic, pack), E4M3/E8M0 scale rounding
  layout                      blocked views (1x16 blocks along any axis, 16x16 tiles) and packing
  hadamard                    the RHT (fixed signs; FWHT butterfly in float32)
  nvfp4 mxfp4 fp8 mxfp8       per-format block arithmetic in the spec's order
  four_over_six eden dbq      the newer recipes' formats: 4/6 block scales, MS-EDEN, double-block scales

They import only each other, ``fp4jax._exact`` and ``fp4jax.random_bits`` (docs/DESIGN.md).
"""
