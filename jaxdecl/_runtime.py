"""Where programs pickled by jaxdecl before its modules moved into rooms look for it.

A serialized executable pickles its keep-alives by the path of the function
that restores them: ``jaxdecl._runtime._unpickled_keepalive``, in programs
saved by earlier versions. That path keeps importing (``tests/test_export.py``
checks); new programs name :mod:`jaxdecl._host.registry`.
"""

from ._host.registry import _unpickled_keepalive  # noqa: F401
