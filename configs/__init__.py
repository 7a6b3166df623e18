"""Training configs: each ``configs/<name>.py`` defines ``get_config()``, a small diff from ``base.py``.

A package (installed with fp4jax) so that config files, ``tools.runs`` and the ``fp4jax-*`` commands can
``from configs import base`` from any directory.
"""
