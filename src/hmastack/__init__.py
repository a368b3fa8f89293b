"""hmastack: the workbench of the hybrid KV cache manager + KV connector series.

The modules follow the data: ``config`` (what the series is pinned to) →
``base`` (fetch, verify, unpack the source releases) → ``workspace`` (apply and
export the patch stack) → ``env`` (the pinned CPU environment) → ``matrix`` (run
every stage's tests) → ``reports`` → ``spec`` / ``docs`` / ``bench``.
"""

__version__ = "0.1.0"
