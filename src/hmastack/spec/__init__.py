"""The TLA+ model: the manifest and TLC runs (``models``), TLC's output and value
syntax (``tlc``), model configurations (``cfg``) and simulated behaviours as
JSON (``traces``). Builds on :mod:`hmastack.core` and :mod:`hmastack.stack`.
"""
