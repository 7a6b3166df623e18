"""Sample from a trained run, or evaluate it on a held-out file: ``python sample.py --workdir runs/tiny``.

The same program as the ``fp4jax-sample`` command (installed by ``pip install -e .``, works from any
directory) and ``python -m tools.sample``; its code is ``tools/sample.py`` (``--help``).
"""
import sys

from tools.sample import *  # noqa: F401,F403  (Generator, sample_logits, evaluate, ... for `import sample`)
from tools.sample import main

if __name__ == "__main__":
  sys.exit(main())
