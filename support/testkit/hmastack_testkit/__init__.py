"""Code shared by our stage tests, the benchmark scenarios, the engine side of
``hmastack e2e`` and the tool itself (one copy of each helper).

``support/testkit`` is on ``PYTHONPATH`` wherever that code runs:

* stage tests and benchmark scenarios (``build/env``): ``hmastack.stack.env.Env.
  test_environ`` adds it to every run it sets up;
* engine processes of ``hmastack e2e`` and ``hmastack bench --throughput``
  (``build/e2e-env``): ``hmastack.e2e.engine.engine_environ`` adds it;
* the tool (``.venv``): ``pyproject.toml`` installs the package with it.

Modules: :mod:`~hmastack_testkit.window` (pure Python, no vLLM),
:mod:`~hmastack_testkit.kv_layouts` (vLLM's KV cache specs and configs),
:mod:`~hmastack_testkit.kvtest` (the stage tests' helpers: hashing set-up,
deterministic Hypothesis settings, the replays' steering and spies),
:mod:`~hmastack_testkit.lmcache_cpu` (LMCache's pointer set-up on CPU),
:mod:`~hmastack_testkit.lmcache_cuda_boundary` (the stage-04 tests' fake of
what LMCache needs CUDA for),
:mod:`~hmastack_testkit.scripted_connector` (the scripted KV connector of
the scheduler-level tests and the scheduler-cost benchmark),
:mod:`~hmastack_testkit.scripted_nixl` (NixlConnector's worker side, scripted),
:mod:`~hmastack_testkit.kv_events` and :mod:`~hmastack_testkit.offloading`;
the subpackage :mod:`~hmastack_testkit.e2e` is the engine side of the
end-to-end runs and the throughput benchmark.
"""
