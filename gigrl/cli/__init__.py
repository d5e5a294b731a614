"""The command-line tools (``gigrl-train``, ``-eval``, ``-compile``, ``-sweep``, ``-export``,
``-fetch``, ``-convert-hf``, ``-serve-retriever``): flag parsing and one-line errors over the
library calls a notebook can make too."""
