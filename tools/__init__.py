"""Command-line tools that use a trained run: ``tools.runs`` (load and write runs), ``tools.hf``
(export to / import from Hugging Face Nemotron-H). ``sample.py`` at the top level samples and evaluates."""
