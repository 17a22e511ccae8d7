"""jaxdecl's version (one place: the package, the wheel and saved programs read it)."""

__version__ = "0.1.0"
