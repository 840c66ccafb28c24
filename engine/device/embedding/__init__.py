"""Sentence embeddings: a BERT encoder in MLX (``bert``) and the engine thread's encoding
of texts (``encoder``). Imports nothing else of ``engine.device``.
"""
