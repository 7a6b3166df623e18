"""``python -m fp4jax.proof``: prove candidates now and print their verdicts (``fp4jax.proof.main``)."""
import sys

from fp4jax.proof import main

sys.exit(main())
