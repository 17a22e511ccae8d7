"""One configuration and its equations.

This room's README.md says what it owns, its invariants and who may import it.
"""
