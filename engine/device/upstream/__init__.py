"""The one seam to upstream internals: every place this engine reaches past the public API of
mlx, mlx-lm or mlx-vlm.

- ``required``: every upstream name the seam relies on, checked once at load
  (``check_upstream``; ``check_vision`` for the vision extra), so an unsupported release
  fails with one ``UnsupportedUpstreamError`` naming each missing name;
- ``batches``: mlx-lm's prefill and decoding batches with row adapters and batched grammar
  masks, installed on a lane's own generator's instances;
- ``decoding_batch``: rows appended to and read from mlx-lm's decoding batch (rejoins);
- ``fast_ops``: ``mx.fast`` and family functions wrapped for the CPU kernels, taking them only
  inside a marked model's forward;
- ``vision_blocks``: a vision tower's blocks recording their outputs (a block per step).

Nothing here imports the rest of ``engine.device``: the wings hand in what they add (masks,
adapter routes, kernel wrappers) and the seam calls it.
"""
