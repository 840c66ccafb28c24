"""A batch row as one record and what each row carries into a step: its sampler, logits
processors and grammar mask, its logprobs, its own cache (cut, copied, rolled back), and
the first tokens read early. Imports nothing else of ``engine.device``.
"""
