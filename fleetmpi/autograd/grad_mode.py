"""Whether operations are recorded for backward: ``no_grad`` turns recording off in a block
(evaluation, in-place parameter updates, recompute's first forward)."""
import functools

_enabled = True


def is_grad_enabled():
    return _enabled


class _GradMode:
    """A context manager and decorator that sets recording to ``self.mode`` inside."""

    mode = True

    def __enter__(self):
        global _enabled
        self._previous = _enabled
        _enabled = self.mode
        return self

    def __exit__(self, *exc):
        global _enabled
        _enabled = self._previous
        return False

    def __call__(self, function):
        @functools.wraps(function)
        def wrapped(*args, **kwargs):
            with type(self)():
                return function(*args, **kwargs)
        return wrapped


class no_grad(_GradMode):
    """Record nothing inside: results have ``stop_gradient=True`` and hold no graph."""

    mode = False


class enable_grad(_GradMode):
    """Record inside, even within ``no_grad``."""

    mode = True
