"""Stable names for kernels: what compiled HLO carries to say which rule to run.

A compiled executable can outlive the process that built it (the persistent
compilation cache, ``jax.experimental.serialize_executable``, ``jax.export``).
So the HLO names a kernel by a fingerprint of everything that decides what it
computes: the op's class (module and qualified name), its configuration, the
rule and the shapes. The same op gives the same fingerprint in every process
(a cache hit, whatever order ops were first used in); a process that does not
know a fingerprint refuses to run it, naming the op, rather than run another.

A configuration that has no canonical text (identity-keyed ops holding arrays,
values of arbitrary classes) gets a token unique to this process and handle:
such executables are correct but never shared across processes.

Example:
    >>> from jaxdecl._op.fingerprint import canonical, digest
    >>> canonical((1, 2.5, "a")) == canonical((1, 2.5, "a"))
    True
    >>> canonical(object()) is None
    True
    >>> len(digest("x", "y"))
    2
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import uuid

import numpy as np

_PROCESS = uuid.uuid4().hex
_counter = itertools.count()


def process_unique() -> str:
    """A token no other handle, in this or any other process, will ever get."""
    return f"process-{_PROCESS}-{next(_counter)}"


def canonical(value) -> str | None:
    """A text that determines `value` in any process, or None when there is none.

    Type-tagged, so that values of different types never share a text.
    """
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, float):
        return f"float:{value.hex()}"
    if isinstance(value, complex):
        return f"complex:{value.real.hex()},{value.imag.hex()}"
    if isinstance(value, np.generic):
        return f"np.{value.dtype.str}:{value.tobytes().hex()}"
    if isinstance(value, np.dtype):
        return f"dtype:{value.str}"
    if isinstance(value, enum.Enum):
        return f"enum:{type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if isinstance(value, type):
        return f"type:{value.__module__}.{value.__qualname__}"
    if isinstance(value, (tuple, list)):
        parts = [canonical(v) for v in value]
        if any(p is None for p in parts):
            return None
        return f"{type(value).__name__}({','.join(parts)})"
    if isinstance(value, frozenset):
        parts = [canonical(v) for v in value]
        if any(p is None for p in parts):
            return None
        return f"frozenset({','.join(sorted(parts))})"
    return None


def configuration_token(cls, items) -> str:
    """The class-and-configuration part of an op's fingerprint.

    `items` are the (name, type, value) triples that decide sharing, or None
    when the op is identity-keyed. A class defined inside a function may
    differ between processes under one name (its closure), so it gets no text
    shared across processes either.
    """
    if items is not None and "<locals>" not in cls.__qualname__:
        text = canonical(tuple((name, value) for name, _, value in items))
        if text is not None:
            return f"{class_path(cls)}|{text}"
    return f"{class_path(cls)}|{process_unique()}"


def digest(*parts: str) -> tuple[int, int]:
    """128 bits of SHA-256 over `parts`, as two signed 64-bit integers (HLO attributes)."""
    h = hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).digest()
    return (int.from_bytes(h[:8], "little", signed=True),
            int.from_bytes(h[8:16], "little", signed=True))


def class_path(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
