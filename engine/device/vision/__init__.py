"""A vision-language model's image side: the tower and its features (``tower``) and an
image row's own prefill (``prefill``). Imports ``rows``, ``adapters`` and the seam.
"""
