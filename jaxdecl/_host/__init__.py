"""Running a rule on XLA's buffers.

This room's README.md says what it owns, its invariants and who may import it.
"""
