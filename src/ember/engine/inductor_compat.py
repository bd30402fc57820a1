"""Inductor behaviour of older torch releases that Ember's compiled steps run into, and how Ember avoids it.

Inductor lowers an op it has no lowering for (Ember's custom ops, and aten ops such as `_weight_int4pack_mm`)
by falling back to the op's own kernel, and the first time it meets each such op it logs a line naming the op
and its arguments. Torch 2.11's `GraphLowering.call_function` builds that string eagerly, whether or not info
logs are on, and the string of an argument is its IR node, which includes the nodes it reads: the input of an
op deep in a decode step prints much of the graph before it, as a tree. On an H200 with torch 2.11 an int4
Llama-3-8B step whose first fallback was `_weight_int4pack_mm` did not finish compiling in 100 s (a stack dump
showed it in `ir.py`'s `__str__`); with the message reduced to the op's name it compiled in 30 s
(BENCHMARKS.md, sixth session). Torch 2.13 formats the message lazily and needs nothing.
"""

from __future__ import annotations

import inspect
import logging

log = logging.getLogger(__name__)

# The eager form of the fallback log call, as written in the torch releases that have it.
_EAGER_CALL = "error.operator_str(target, args, kwargs)"


def _op_only(target, args, kwargs) -> str:
    return f"  target: {target}\n  ({len(args)} args and {len(kwargs or {})} kwargs, not formatted: see ember.engine.inductor_compat)"


_op_only.ember = True


def cheap_fallback_messages() -> bool:
    """Where this torch formats inductor's fallback message eagerly, has it name only the op (once per
    process; the message is an info log line, and an error built from it still names the op). Returns
    whether the workaround is in place."""
    try:
        from torch._inductor import exc, graph
    except ImportError:  # a torch without inductor compiles nothing
        return False
    if getattr(exc.OperatorIssue.operator_str, "ember", False):
        return True
    try:
        source = inspect.getsource(graph.GraphLowering.call_function)
    except (OSError, TypeError):  # no source shipped: leave torch as it is
        return False
    if _EAGER_CALL not in source:
        return False
    exc.OperatorIssue.operator_str = staticmethod(_op_only)
    log.debug("inductor's fallback messages name only the op (eager formatting in this torch)")
    return True
