"""Where mlx runs: the device side of the engine, in wings that point one way.

``loading`` builds a model's ``lane``s; the lanes use ``speedups``, ``vision``, ``prefix``,
``rows`` and ``adapters``; ``kernels`` and every wing reach upstream internals only through
``upstream``; ``embedding`` stands apart. ``tests/unit/test_layering.py`` holds each wing's
row; ``docs/architecture.md`` names every module.
"""
