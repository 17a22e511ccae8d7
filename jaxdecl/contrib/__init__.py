"""Optional bindings of third-party libraries as jaxdecl primitives.

Each submodule imports its library on import, so ``import jaxdecl`` never
needs them: ``from jaxdecl.contrib import ducc`` requires ``ducc0``,
``from jaxdecl.contrib import finufft`` requires ``finufft``.
"""
