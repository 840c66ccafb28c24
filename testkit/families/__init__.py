"""The family matrix: real tokenizers and chat templates, tiny models of real architectures.

- ``FAMILIES`` (``catalog``): name -> ``Family`` (architecture, vocabulary, template, tokens).
- ``built_family_model(family, root)``: the family's tiny model directory, built once.
- ``family_tokenizer(family)``: its ``tokenizers.Tokenizer`` (cached by content).
- ``reference_ids(family, tokenizer)`` (``references``): the reference tokenization each
  vocabulary is checked against, with the match count.
- ``tool_transcript`` / ``fit_to_transcripts`` (``transcripts``, ``fitting``): a turn in
  the family's native tool-call syntax, rendered by its real template, and a few seconds
  of fitting that make the tiny model write it under greedy decoding.
- ``AssetUnavailable``: raised when a PyPI package the sources come from cannot be fetched.
"""

from testkit.families.assets import AssetUnavailable
from testkit.families.build import build_family_model, built_family_model, family_tokenizer
from testkit.families.catalog import FAMILIES, Family

__all__ = ["FAMILIES", "AssetUnavailable", "Family", "build_family_model",
           "built_family_model", "family_tokenizer"]
