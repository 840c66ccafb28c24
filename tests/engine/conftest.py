"""Fixtures shared by the engine tests."""

from .lane_recorder import on_lane_thread

__all__ = ["on_lane_thread"]
