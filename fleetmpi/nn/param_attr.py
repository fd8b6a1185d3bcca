"""``ParamAttr``: Paddle's description of a parameter, given to a layer as ``weight_attr`` or
``bias_attr`` (``fleetmpi.ParamAttr``, also ``fleetmpi.framework.ParamAttr``).

``name``, ``initializer`` and ``trainable`` act: the parameter keeps the name (the layer that
flattens a model names only the parameters without one), its values come from the initializer
(a ``fleetmpi.nn.initializer`` or any callable of the shape), and an untrainable parameter
gets no gradient and is left out of the optimizer's update. ``learning_rate``, ``regularizer``
and ``need_clip`` at values other than their defaults are refused, since the optimizer updates
the flat buffers of all its parameters with one rule: one learning rate, its own
``weight_decay`` and its ``grad_clip`` over every gradient.

A layer argument may also be what Paddle takes there: None (the defaults), a name string, an
initializer, True, or False (no such parameter: no bias; for a norm layer's scale or shift, a
constant one that is not trained, as Paddle's batch norm keeps it).
"""
import dataclasses
import numbers


@dataclasses.dataclass(frozen=True)
class ParamAttr:
    """Paddle's ``ParamAttr(name, initializer, learning_rate, regularizer, trainable,
    need_clip)``; module docstring."""

    name: str = None
    initializer: object = None
    learning_rate: float = 1.0
    regularizer: object = None
    trainable: bool = True
    need_clip: bool = True

    def __post_init__(self):
        if self.name is not None and not isinstance(self.name, str):
            raise ValueError(f"ParamAttr name must be a string or None, not {self.name!r}")
        if self.initializer is not None and not callable(self.initializer):
            raise ValueError(f"ParamAttr initializer must be an initializer (a callable of the "
                             f"shape) or None, not {self.initializer!r}")
        if not isinstance(self.trainable, bool):
            raise ValueError(f"ParamAttr trainable must be True or False, not "
                             f"{self.trainable!r}")
        rate = self.learning_rate
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or rate != 1.0:
            raise ValueError(f"ParamAttr learning_rate={rate!r}: only 1.0 is allowed; the "
                             "optimizer updates all its parameters at one learning rate (set "
                             "the optimizer's, or trainable=False to freeze a parameter)")
        if self.regularizer is not None:
            raise ValueError(f"ParamAttr regularizer={self.regularizer!r}: only None is "
                             "allowed; regularise through the optimizer's weight_decay, which "
                             "applies to all its parameters")
        if self.need_clip is not True:
            raise ValueError(f"ParamAttr need_clip={self.need_clip!r}: only True is allowed; "
                             "the optimizer's grad_clip clips every gradient it updates")


def to_attr(value, what):
    """``value`` as a ``ParamAttr``, or False for no parameter (module docstring); ``what``
    names the argument in errors."""
    if value is None or value is True:
        return ParamAttr()
    if value is False or isinstance(value, ParamAttr):
        return value
    if isinstance(value, str):
        return ParamAttr(name=value)
    if callable(value):
        return ParamAttr(initializer=value)
    raise ValueError(f"{what} must be a fleetmpi.ParamAttr, a name, an initializer, True, False "
                     f"or None, not {value!r}")


def needed(value, what):
    """``to_attr`` for a parameter the layer cannot do without (a weight): False refused."""
    attr = to_attr(value, what)
    if attr is False:
        raise ValueError(f"{what}=False: the layer cannot do without this parameter; give a "
                         "ParamAttr or None")
    return attr


def fixed_when_false(value, what):
    """For a norm layer's scale or shift: False becomes a parameter that is not trained."""
    attr = to_attr(value, what)
    return ParamAttr(trainable=False) if attr is False else attr
