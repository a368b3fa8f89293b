"""The stage matrix: vLLM's suite, our stage tests and ruff at every stage and
commit (``stages``, with the pytest runs in ``pytest_runs``) and the reports
written from them (``reports``). Builds on :mod:`hmastack.core` and
:mod:`hmastack.stack`.
"""
