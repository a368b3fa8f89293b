"""Shared ground of every step: the configuration (``config``), the TOML files'
schemas and their error messages (``tomlfile``), errors,
the process runner (``process``), console and step progress (``progress``), git
(``gitutil``) and Markdown helpers (``markdown``). Imports nothing else of hmastack.
"""
