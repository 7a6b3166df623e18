"""Experiments on top of the fp4jax pipeline: the recipe study and the numerics study.

  python -m experiments.study --config configs/study_cpu.py         # bf16 / fp8 / mxfp4 / nvfp4 + ablations
  python -m experiments.numerics_study --run runs/study_cpu/nvfp4/seed0 # SQNR and gradient cosines

Nothing in ``fp4jax``, ``models`` or ``training`` imports this package.
"""
