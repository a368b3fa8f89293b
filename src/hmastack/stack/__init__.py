"""The patch stack: fetch and unpack the pinned releases (``base``), the pinned CPU
environment (``env``), apply and export the patches (``workspace``). Builds on
:mod:`hmastack.core` only.
"""
