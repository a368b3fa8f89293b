"""The engine side of ``hmastack e2e`` and ``hmastack bench --throughput``: code
that runs inside build/e2e-env, in an engine process with a stage tree first on
``PYTHONPATH`` (``hmastack.e2e.engine.engine_support``).

Entry points (``python -m``): :mod:`~hmastack_testkit.e2e.driver` (one plan of
scenarios), :mod:`~hmastack_testkit.e2e.throughput` (one measured batch),
:mod:`~hmastack_testkit.e2e.models` (the tiny models). vLLM loads
:mod:`~hmastack_testkit.e2e.connector` by ``kv_connector_module_path``.
The tool's own tests import :mod:`~hmastack_testkit.e2e.scenarios` and
:mod:`~hmastack_testkit.e2e.models`, which import no vLLM at module level.
"""
