"""The primitive under JAX.

This room's README.md says what it owns, its invariants and who may import it.
"""
