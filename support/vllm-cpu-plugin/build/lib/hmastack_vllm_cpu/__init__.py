"""Register vLLM's ``CpuPlatform`` for an unpacked vLLM source tree.

vLLM infers its platform from the installed version string (``0.13.0+cpu``). A
source tree on ``PYTHONPATH`` has no such suffix, so vLLM would fall back to
``UnspecifiedPlatform``. This package is installed into the test environment
only; vLLM itself stays unpatched. vLLM calls :func:`register` through the
``vllm.platform_plugins`` entry point group.
"""


def register() -> str:
    """Return the qualified name of the platform class vLLM should use."""
    return "vllm.platforms.cpu.CpuPlatform"
