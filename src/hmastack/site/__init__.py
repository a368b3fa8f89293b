"""The design site: page builders and the build (``docs``, ``pages``), the mkdocs
hook (``hook``) and the readers of patches, reports, the model and the
benchmarks it renders. The top layer: it reads what every other step wrote.
"""
