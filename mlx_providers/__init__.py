"""LangChain and LlamaIndex adapters over the shared ``engine`` (coming in later releases)."""
