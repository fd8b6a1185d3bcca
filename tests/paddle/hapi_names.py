"""``paddle.hapi.model.to_list`` for the ported tests that import it (``test_metrics.py`` uses it
only in tests left out): Paddle's hapi comes to fleetmpi with ``fleetmpi.Model``, built
elsewhere, and this goes when the port's EDITS can name fleetmpi's."""


def to_list(value):
    """``value`` as a list: a list or tuple's items, ``[]`` for None, else ``[value]``."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
