"""The command-line programs above ``training``: ``tools.train`` (``fp4jax-train``, ``train.py``),
``tools.sample`` (``fp4jax-sample``, ``sample.py``), ``tools.hf`` (``fp4jax-hf``: export to / import from
Hugging Face Nemotron-H) and ``tools.runs`` (load and write runs)."""
