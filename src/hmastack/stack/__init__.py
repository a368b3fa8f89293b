"""The patch stack: fetch and unpack the pinned releases (``base``), the pinned CPU
environment (``env``), apply and export the patches (``workspace``), delete the
build folder when no workspace holds unexported work (``clean``). Builds on
:mod:`hmastack.core` only.
"""
