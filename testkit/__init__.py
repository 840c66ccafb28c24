"""Scaffolding shared by tests/ and bench/: a tiny random model, a churn driver, a numpy BERT.

Not part of the installed package; both import it from the repository root.
"""
