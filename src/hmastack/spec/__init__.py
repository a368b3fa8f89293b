"""The TLA+ model: the manifest and TLC settings (``manifest``), Java and the TLC
jar (``install``), TLC runs checked against the manifest (``models``), model
configurations (``cfg``, the one reader of ``spec/models/*.cfg``), TLC's output
and value syntax (``tlc``) and simulated behaviours as JSON (``traces``). Builds
on :mod:`hmastack.core` and :mod:`hmastack.stack`.
"""
