"""Conformance: TLC behaviours and random schedules replayed on the series and on
deliberately broken copies. Builds on core, stack, matrix and spec.
"""
