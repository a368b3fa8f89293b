"""Conformance: TLC behaviours and random schedules replayed on stage 03 and on
deliberately broken copies. Builds on core, stack, matrix and spec.
"""
