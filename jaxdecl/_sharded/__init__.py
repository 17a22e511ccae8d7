"""How a call runs across devices.

This room's README.md says what it owns, its invariants and who may import it.
"""
