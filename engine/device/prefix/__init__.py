"""Prefix reuse: what a lane's caches can resume, the in-memory store's copies, and its
disk tier. Imports only ``rows``.
"""
