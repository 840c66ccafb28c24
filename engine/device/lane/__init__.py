"""The lanes: the batch lane on mlx-lm's generator (``batch_lane``, its ``generator_seam``
and ``decoded_tokens``) and the serial lane. Imports every wing below it, never ``loading``.
"""
