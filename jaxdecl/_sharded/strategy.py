"""How one equation runs: the one decision, made in one place, and its name.

Every call of an op, eager or traced, asks :func:`choose` with the
:class:`CallFacts` it knows; the caller then dispatches on the returned
:class:`Strategy`. Nothing else decides between mechanisms, so the eager and
the jitted call of the same op on the same arrays cannot disagree.

=====================================================  ==================
facts                                                  strategy
=====================================================  ==================
traceable rule (JAX-valued)                            ``INLINE``
one device, or inside ``shard_map``                    ``DIRECT``
eager, operands on one mesh                            ``PER_SHARD_MAP``
eager, operands on no common mesh                      ``ONE_DEVICE``
eager, no declaration, no vmapped dim split, 1 process ``ONE_DEVICE``
eager, Explicit axes, no declaration, JAX < 0.9        ``ONE_DEVICE``
jit, Explicit axes                                     ``PER_SHARD_MAP``
jit, Explicit axes, no declaration, JAX < 0.9          ``DIRECT``
jit, Auto axes, declared, JAX < 0.7 or Shardy off      ``DIRECT``
jit, Auto axes, elementwise declaration                ``SPLIT``
jit, Auto axes, otherwise                              ``PARTITIONED``
=====================================================  ==================

An op without a declaration takes the same strategies as a declared one: its
implied declaration needs every dim whole except the batch dims ``vmap``
added, and it runs once per distinct block (not once per device).

Example:
    >>> choose(CallFacts(devices=4, eager=True, common_mesh=True))
    <Strategy.PER_SHARD_MAP: 'per-shard map'>
    >>> choose(CallFacts(devices=4, declared=True, elementwise=True))
    <Strategy.SPLIT: 'XLA-split call'>
    >>> choose(CallFacts(devices=1))
    <Strategy.DIRECT: 'direct call'>
"""

from __future__ import annotations

import dataclasses
import enum

from .. import _compat


class Strategy(enum.Enum):
    """The mechanisms an equation can run by (see the module docstring's table)."""

    #: The rule is JAX-valued: its jaxpr is inlined, JAX partitions it like any code.
    INLINE = "inline"
    #: One custom call of the kernel on whatever the call site holds: one device,
    #: the blocks inside ``shard_map``, or (where JAX cannot split) gathered inputs.
    DIRECT = "direct call"
    #: One custom call that XLA's batch partitioner splits per device itself.
    SPLIT = "XLA-split call"
    #: A ``custom_partitioning`` call whose callback plans the split at compile time.
    PARTITIONED = "partitioned call"
    #: A ``shard_map`` of the kernel over the plan's blocks, built by
    #: :mod:`jaxdecl._sharded.shardmap` (the plan is known from the operands' shardings).
    PER_SHARD_MAP = "per-shard map"
    #: The operands moved whole onto one device and run there (no common mesh).
    ONE_DEVICE = "one device"


@dataclasses.dataclass(frozen=True)
class CallFacts:
    """What is known about one call when it is run or lowered."""

    devices: int = 1  # devices the operands (or the program) span
    traceable: bool = False  # the rule is JAX-valued
    declared: bool = False  # the op declares how it splits
    manual: bool = False  # inside shard_map (the rule sees blocks already)
    explicit: bool = False  # mesh axes of type Explicit
    eager: bool = False  # outside any trace: run now
    common_mesh: bool = False  # eager: the operands share one mesh
    splits: bool = True  # eager: the operands are split along a dim the op may split
    addressable: bool = True  # eager: this process holds every operand whole
    elementwise: bool = False  # the equation's factors allow an XLA split
    splits_per_shard: bool = True  # this JAX can run a declaration per shard under jit
    explicit_reductions: bool = True  # this JAX can psum inside an Explicit-axes program


def choose(facts: CallFacts) -> Strategy:
    """The strategy for a call with these facts (see the module docstring's table)."""
    if facts.traceable:
        return Strategy.INLINE
    if facts.devices <= 1 or facts.manual:
        return Strategy.DIRECT
    if facts.eager:
        if not facts.common_mesh:
            return Strategy.ONE_DEVICE
        if not facts.declared and facts.addressable and (
                not facts.splits or (facts.explicit and not facts.explicit_reductions)):
            # Nothing to run per shard: one device and a copy back is cheaper than a
            # collective (and running once over Explicit axes needs a psum: JAX >= 0.9).
            return Strategy.ONE_DEVICE
        return Strategy.PER_SHARD_MAP
    if facts.explicit:
        # The types say where every block is: a shard_map needs no partitioner's help.
        if not facts.declared and not facts.explicit_reductions:
            # Running once needs a psum, which XLA cannot compile over Explicit
            # axes before JAX 0.9: every device runs the rule on gathered inputs.
            return Strategy.DIRECT
        return Strategy.PER_SHARD_MAP
    if not facts.splits_per_shard:
        return Strategy.DIRECT  # XLA gathers; a declared op warns once (see _lowering)
    return Strategy.SPLIT if facts.elementwise else Strategy.PARTITIONED


def splits_per_shard() -> bool:
    """This JAX runs a declaration per shard under ``jit`` (0.7+, with Shardy)."""
    return _compat.SPLITS_PER_SHARD and _compat.shardy_enabled()


def facts(**known) -> CallFacts:
    """CallFacts with this JAX's capabilities filled in."""
    return CallFacts(splits_per_shard=splits_per_shard(),
                     explicit_reductions=_compat.EXPLICIT_REDUCTIONS, **known)


def decide(**known) -> Strategy:
    """The strategy for a call with these facts, this JAX's capabilities filled in:
    ``choose(facts(**known))``, what every caller asks."""
    return choose(facts(**known))
