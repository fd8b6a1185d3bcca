"""The dtype policy operations compute in: amp's per-operator casts.

A policy has ``dtype_for(op_type)``: the dtype an operator named ``op_type`` computes in
(float16 for amp's white list, float32 for its black list) or None (the dtype its inputs come
in). Inside ``autocast(policy)`` every ``Function`` with an ``op_type`` casts its floating
inputs to that dtype first, through recorded casts, so their gradients go back in the dtype
the inputs came in (float32 master weights get float32 gradients).
"""
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
