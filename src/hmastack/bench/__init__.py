"""The benchmarks: scenarios and their expected figures, orchestration, tables and
plots, the scheduler-cost counts (``cost``, ``callgrind``), the throughput run
(``throughput``) and the trees they run on (``trees``). Builds on core, stack,
matrix and e2e (the engine launcher of the throughput run).
"""
