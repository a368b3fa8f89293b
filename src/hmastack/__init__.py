"""hmastack: the workbench of the hybrid KV cache manager + KV connector series.

One subpackage per concern, in pipeline order; each imports only those before it:
``core`` (configuration, errors, the process runner, progress, git, Markdown) →
``stack`` (fetch and unpack the releases, the pinned CPU environment, apply and
export the patches) → ``matrix`` (every stage's and commit's tests, the reports) →
``spec`` (the TLA+ model and TLC) → ``conform`` (the model against the series) →
``e2e`` (the real engine) → ``bench`` (the benchmarks) → ``site`` (the design
site). ``cli`` parses every command line; ``pipeline`` is ``hmastack run``.
"""

__version__ = "0.1.0"
