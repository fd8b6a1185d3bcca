"""Typed, range-checked views of the messages of ``distributed_strategy.proto``.

The schema says everything about a field: its type and default (protobuf) and what it may hold
(the custom options ``range``, ``choices`` and ``default_list``). This module turns that into
Python objects that refuse a wrong value with a message naming the field and what is allowed.

Messages keep proto2 presence, as Paddle's do: a field holds a value only where one was
assigned (or loaded), so a saved prototxt states what the user set and nothing else; reading an
unset field gives its default (for a repeated field with a ``default_list``, that list).
"""
import decimal
import math
import numbers
from collections.abc import Mapping, MutableMapping

from google.protobuf.descriptor import FieldDescriptor

from fleetmpi.proto import distributed_strategy_pb2 as schema

from .suggest import did_you_mean

_INT_BOUNDS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1, "int32"),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1, "int64"),
}
_REAL_TYPES = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


class ConfigError(ValueError):
    """A value, key or file that the strategy schema does not allow."""


class UnknownKeyError(ConfigError, KeyError):
    """A key that is not a field of the message; also a KeyError for mapping lookups."""

    def __str__(self):
        return self.args[0]


class UnknownAttributeError(AttributeError, TypeError):
    """An attribute that is not a field of the strategy; also a TypeError, as Paddle's
    ``DistributedStrategy`` raises for an unknown attribute."""


class Interval:
    """An interval written as in the schema, e.g. ``[1, inf)`` or ``(0, 1)``."""

    def __init__(self, text):
        self.text = text
        body = text.strip()
        self.low_closed = body[0] == "["
        self.high_closed = body[-1] == "]"
        low, high = body[1:-1].split(",")
        self.low = float(low)
        self.high = float(high)

    def __contains__(self, x):
        above = x >= self.low if self.low_closed else x > self.low
        below = x <= self.high if self.high_closed else x < self.high
        return above and below

    def __str__(self):
        return self.text


def _option(field, extension):
    options = field.GetOptions()
    return options.Extensions[extension] if options.HasExtension(extension) else None


def field_range(field):
    """The allowed interval of a numeric field, or None if any value of its type is allowed."""
    text = _option(field, schema.range)
    return Interval(text) if text else None


def field_choices(field):
    """The allowed values of a string field, or None if any string is allowed."""
    text = _option(field, schema.choices)
    return text.split("|") if text else None


def _is_message(field):
    return field.type == FieldDescriptor.TYPE_MESSAGE


def _is_repeated(field):
    return field.is_repeated


def _parse_element(field, text):
    if field.type in _REAL_TYPES:
        return float(text)
    if field.type in _INT_BOUNDS:
        return int(text)
    return text


def default_of(field):
    """The default of a non-message field, as a Python value (a list for repeated fields)."""
    if _is_repeated(field):
        text = _option(field, schema.default_list)
        return [_parse_element(field, t.strip()) for t in text.split(",")] if text else []
    return field.default_value


def describe_allowed(field):
    """Words that say what a field may hold, for error messages."""
    if field.type == FieldDescriptor.TYPE_BOOL:
        kind = "True or False"
    elif field.type in _INT_BOUNDS:
        kind = "an integer"
    elif field.type in _REAL_TYPES:
        kind = "a number"
    else:
        kind = "a string"
    rng, choices = field_range(field), field_choices(field)
    if rng is not None:
        kind += f" in {rng}"
    if choices is not None:
        kind += " among " + ", ".join(repr(c) for c in choices)
    if _is_repeated(field):
        kind = f"a list, each element {kind}"
    return kind


def _shown(value):
    """``value`` as an error message writes it; an integer of more than 30 digits as its first
    digits and power of ten (``1.000e+400``), since Python refuses to write out the longest."""
    if isinstance(value, numbers.Integral) and abs(int(value)) >= 10 ** 30:
        return format(decimal.Decimal(int(value)), ".3e")
    return repr(value)


def _coerce_scalar(field, value, where):
    """``value`` as the Python type the field stores, or TypeError/ConfigError naming ``where``."""
    def wrong_type():
        return TypeError(f"{where} = {value!r} has type {type(value).__name__}; "
                         f"allowed: {describe_allowed(field)}")

    if field.type == FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool) and type(value).__name__ != "bool_":
            raise wrong_type()
        return bool(value)
    if field.type == FieldDescriptor.TYPE_STRING:
        if not isinstance(value, str):
            raise wrong_type()
        choices = field_choices(field)
        if choices is not None and value not in choices:
            raise ConfigError(f"{where} = {value!r} is not allowed; allowed: "
                              f"{describe_allowed(field)}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise wrong_type()
    if field.type in _INT_BOUNDS:
        if not isinstance(value, numbers.Integral):
            raise wrong_type()
        coerced = int(value)
        low, high, name = _INT_BOUNDS[field.type]
        if not low <= coerced <= high:
            raise ConfigError(f"{where} = {_shown(value)} does not fit in {name}; allowed: "
                              f"{describe_allowed(field)}")
    else:
        try:
            coerced = float(value)
        except OverflowError:
            raise ConfigError(f"{where} = {_shown(value)} does not fit in a double; allowed: "
                              f"{describe_allowed(field)}") from None
        if math.isnan(coerced):
            raise ConfigError(f"{where} = nan is not allowed; allowed: {describe_allowed(field)}")
    rng = field_range(field)
    if rng is not None and coerced not in rng:
        raise ConfigError(f"{where} = {value!r} is outside the allowed range; allowed: "
                          f"{describe_allowed(field)}")
    return coerced


def coerce(field, value, where):
    """Check ``value`` for a non-message field and return it in the form the message stores."""
    if _is_repeated(field):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"{where} = {value!r} has type {type(value).__name__}; "
                            f"allowed: {describe_allowed(field)}")
        return [_coerce_scalar(field, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return _coerce_scalar(field, value, where)


def get_value(message, field):
    """A non-message field's value as a plain Python value (lists are copies); an empty
    repeated field reads as its ``default_list``."""
    value = getattr(message, field.name)
    if _is_repeated(field):
        return list(value) if value else default_of(field)
    return value


def set_value(message, field, value):
    """Store an already coerced value; an empty repeated field takes its default list."""
    if _is_repeated(field):
        container = getattr(message, field.name)
        del container[:]
        container.extend(value if value else default_of(field))
    else:
        setattr(message, field.name, value)


def validate(message, prefix=""):
    """Check every field of a message built elsewhere (a parsed file) against the schema."""
    for field in message.DESCRIPTOR.fields:
        where = prefix + field.name
        if _is_message(field):
            validate(getattr(message, field.name), where + ".")
        else:
            coerce(field, get_value(message, field), where)


def differences(message, reference, prefix=""):
    """``(dotted name, value)`` of every field whose value differs from ``reference``'s (a
    field set to its default does not differ from one left unset)."""
    found = []
    for field in message.DESCRIPTOR.fields:
        where = prefix + field.name
        if _is_message(field):
            found += differences(getattr(message, field.name),
                                 getattr(reference, field.name), where + ".")
        elif get_value(message, field) != get_value(reference, field):
            found.append((where, get_value(message, field)))
    return found


def lookup_field(message, key, owner, extra_names=()):
    """The field ``key`` of ``message``, or UnknownKeyError naming ``owner`` and the valid keys."""
    fields = message.DESCRIPTOR.fields_by_name
    if isinstance(key, str) and key in fields:
        return fields[key]
    names = list(fields) + list(extra_names)
    raise UnknownKeyError(f"{owner} has no key {key!r}{did_you_mean(key, names)}; valid keys: "
                          f"{', '.join(names)}")


class ConfigView(MutableMapping):
    """A live, dict-like view of one ``*_configs`` message of a strategy.

    Reading gives the current values; assigning a key checks it first. ``update`` (and assigning
    a whole dict to the strategy attribute) changes only the keys given, and changes nothing
    if any of them is invalid.
    """

    def __init__(self, message, name, extra=None):
        self._message = message
        self._name = name
        # Keys of Paddle's message that this one lacks (``DistributedStrategy`` keeps them):
        # an object with ``names``, ``get(key)``, ``rendered({key: value})`` (checks, returns
        # what ``keep`` takes) and ``keep``.
        self._extra = extra

    def _extra_names(self):
        return () if self._extra is None else self._extra.names

    def _field(self, key):
        return lookup_field(self._message, key, self._name, self._extra_names())

    def __getitem__(self, key):
        if key in self._extra_names():
            return self._extra.get(key)
        field = self._field(key)
        value = get_value(self._message, field)
        return ConfigList(value, self, field.name) if _is_repeated(field) else value

    def __setitem__(self, key, value):
        self.update({key: value})

    def __delitem__(self, key):
        raise TypeError(f"keys of {self._name} cannot be deleted; assign the default instead")

    def __iter__(self):
        return iter(self._message.DESCRIPTOR.fields_by_name)

    def __len__(self):
        return len(self._message.DESCRIPTOR.fields)

    def update(self, values=(), **kwargs):
        values = dict(values, **kwargs)
        extra = {k: v for k, v in values.items() if k in self._extra_names()}
        checked = [(self._field(k), v) for k, v in values.items() if k not in extra]
        checked = [(f, coerce(f, v, f"{self._name}[{f.name!r}]")) for f, v in checked]
        kept = self._extra.rendered(extra) if extra else None
        for field, value in checked:
            set_value(self._message, field, value)
        if kept:
            self._extra.keep(kept)

    def __repr__(self):
        return repr(dict(self))


class ConfigList(list):
    """A list-valued key of a ``ConfigView`` (``recompute_configs["checkpoints"]``): a list of
    the current values whose in-place changes (``append``, ``extend``, ``+=``, item assignment,
    ``remove``...) are checked like an assignment of the whole key and written back to the
    strategy, or refused with the same error, changing nothing."""

    def __init__(self, values, view, key):
        super().__init__(values)
        self._view, self._key = view, key

    def _change(self, method, *args):
        candidate = list(self)
        result = getattr(list, method)(candidate, *args)
        self._view[self._key] = candidate
        list.__init__(self, self._view[self._key])
        return result


def _written_back(method):
    def change(self, *args):
        result = self._change(method, *args)
        return self if method in ("__iadd__", "__imul__") else result
    change.__name__ = method
    change.__doc__ = getattr(list, method).__doc__
    return change


for _method in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse",
                "__setitem__", "__delitem__", "__iadd__", "__imul__"):
    setattr(ConfigList, _method, _written_back(_method))


def require_mapping(value, where):
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be assigned a dict of its keys, not "
                        f"{type(value).__name__} {value!r}")
    return value
