"""Per-row LoRA adapters on one base model (``row_adapters``): loaded, stacked by rank,
and run for each row's slot. Imports nothing else of ``engine.device``.
"""
