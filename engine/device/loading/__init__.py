"""Loading a model and building its lanes: the architecture check, weights in and their
policy, memory figures, the padding probe, cache layouts and a sharded engine's
collectives. The top wing: it imports the others; none imports it.
"""
