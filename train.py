"""Pretrain a language model with fp4jax: ``python train.py --config configs/tiny.py``.

The same program as the ``fp4jax-train`` command (installed by ``pip install -e .``, works from any
directory) and ``python -m tools.train``; its code and flags are in ``tools/train.py`` (``--help``).
"""
from tools.train import run

if __name__ == "__main__":
  run()
