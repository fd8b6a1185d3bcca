"""The dtype policy operations compute in: amp's per-operator casts.

A policy has ``dtype_for(op_type)``: the dtype an operator named ``op_type`` computes in
(float16 or bfloat16 for amp's white list, float32 for its black list) or None (the dtype its
inputs come in). Inside ``autocast(policy)`` every ``Function`` with an ``op_type`` casts its
floating inputs to that dtype first, through recorded casts, so their gradients go back in the
dtype the inputs came in (float32 master weights get float32 gradients).
"""
import numpy as np

from ..core import backend

_policy = None


def current_policy():
    return _policy


class autocast:
    """Run the block under ``policy`` (None: no casts)."""

    def __init__(self, policy):
        self.policy = policy

    def __enter__(self):
        global _policy
        self._previous = _policy
        _policy = self.policy
        return self

    def __exit__(self, *exc):
        global _policy
        _policy = self._previous
        return False


def input_dtype(op_type, dtype):
    """The dtype a floating input of ``dtype`` has inside the forward of an operator named
    ``op_type`` under the current policy (what ``Function.apply`` casts it to), so a caller can
    choose how to run the operator before it is applied."""
    cast = None if _policy is None or op_type is None else _policy.dtype_for(op_type)
    dtype = np.dtype(dtype)
    return np.dtype(cast) if cast is not None and backend.is_floating(dtype) else dtype
