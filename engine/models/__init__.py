"""Model acquisition: the default model, GGUF conversion, the per-user conversion cache."""

from engine.models.resolve import config_context_limit, model_path_for, resolve_model

__all__ = ["config_context_limit", "model_path_for", "resolve_model"]
