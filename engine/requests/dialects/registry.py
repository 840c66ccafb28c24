"""Which dialect a tokenizer speaks: the first family whose marks it carries, else the
default (tagged JSON in mlx-lm's markers). Families are checked most specific first."""

from __future__ import annotations

from engine.requests.dialects.deepseek_r1 import DeepSeekR1
from engine.requests.dialects.dialect import Dialect, TokenizerFacts
from engine.requests.dialects.gemma4 import Gemma4
from engine.requests.dialects.harmony import Harmony
from engine.requests.dialects.llama3 import Llama3
from engine.requests.dialects.mistral import Mistral
from engine.requests.dialects.pythonic import Pythonic
from engine.requests.dialects.qwen_xml import QwenXml

# Family dialects, most specific first; each module of this package adds its own.
FAMILIES: tuple[type[Dialect], ...] = (
    Harmony,
    Mistral,
    DeepSeekR1,
    QwenXml,
    Gemma4,
    Pythonic,
    Llama3,
)


def dialect_for(facts: TokenizerFacts) -> Dialect:
    """The dialect of the tokenizer these facts describe."""
    for family in FAMILIES:
        if family.matches(facts):
            return family(facts)
    return Dialect(facts)
