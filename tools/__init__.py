"""The command-line programs above ``training``: ``tools.train`` (``fp4jax-train``, ``train.py``),
``tools.sample`` (``fp4jax-sample``, ``sample.py``), ``tools.hf`` (``fp4jax-hf``: export to / import from
Hugging Face Nemotron-H), ``tools.profile`` (``fp4jax-profile``: a captured profile's time by fp4jax's scopes,
read by ``tools.xplane``, named by ``tools.op_names``) and ``tools.runs`` (load and write runs)."""
