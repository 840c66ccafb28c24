"""The native CPU kernels (``cpu_kernels``, built from ``native/`` at install) and the
layers of a loaded model that call them (``kernel_layers``). Imports only the upstream seam.
"""
