"""Grammar fast-forward and prompt-lookup speculation for the batch lane, and the report
of what each speed-up does on the loaded model (``report``). Imports ``rows``, ``adapters``
and ``prefix``; the lane hands them its seam.
"""
