"""``DistributedStrategy``, ``BuildStrategy`` and ``ExecutionStrategy``: Fleet's configuration
surface, stored in the messages of ``distributed_strategy.proto``.

Every attribute is a field of the schema; assignments are checked against it and never have side
effects on other fields, so attributes can be set in any order with the same result.
"""
import os
import types

from google.protobuf import text_format

from . import paddle_values, prototxt, schema_view
from .paddle_fields import PADDLE_ONLY
from fleetmpi.core.files import write_atomically
from fleetmpi.proto import distributed_strategy_pb2 as schema


def _read_text(pb_file):
    """The text of the strategy file ``pb_file``; a ConfigError naming it and the first byte
    that is not UTF-8, where one is not."""
    with open(pb_file, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise schema_view.ConfigError(
            f"{os.fspath(pb_file)}: byte {data[exc.start]:#04x} at offset {exc.start} is not "
            "UTF-8 text; a strategy file is protobuf text format in UTF-8") from None


class _MessageObject:
    """Attribute access to the fields of one schema message.

    An object either owns a fresh message or is a live view of a message inside another object
    (``strategy.build_strategy.fuse_bn_act_ops = True`` changes the strategy).
    """

    _message_class = None
    # Message fields shown as objects of these classes; other message fields are dict-like views.
    _sub_objects = {}

    def __init__(self):
        object.__setattr__(self, "_message", self._message_class())

    @classmethod
    def _view(cls, message):
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_message", message)
        return obj

    def _extra_names(self):
        return ()

    def _field(self, name):
        try:
            return schema_view.lookup_field(self._message, name, type(self).__name__,
                                            self._extra_names())
        except schema_view.UnknownKeyError as exc:
            raise schema_view.UnknownAttributeError(
                str(exc).replace("has no key", "has no attribute")) from None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        field = self._field(name)
        if field.message_type is not None:
            return self._present(field)
        return schema_view.get_value(self._message, field)

    def __setattr__(self, name, value):
        field = self._field(name)
        if field.message_type is not None:
            self._assign_message(field, value)
        else:
            where = f"{type(self).__name__}.{name}"
            schema_view.set_value(self._message, field, schema_view.coerce(field, value, where))

    def _present(self, field):
        sub = getattr(self._message, field.name)
        if field.name in self._sub_objects:
            return self._sub_objects[field.name]._view(sub)
        return schema_view.ConfigView(sub, field.name)

    def _assign_message(self, field, value):
        sub_class = self._sub_objects.get(field.name)
        if sub_class is not None and isinstance(value, sub_class):
            getattr(self._message, field.name).CopyFrom(value._message)
            return
        if sub_class is not None and isinstance(value, _MessageObject):
            raise TypeError(f"{field.name} must be assigned a {sub_class.__name__} or a dict "
                            f"of its fields, not a {type(value).__name__}")
        mapping = schema_view.require_mapping(value, field.name)
        view = self._present(field) if sub_class is None else \
            schema_view.ConfigView(getattr(self._message, field.name), field.name)
        view.update(mapping)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._message.DESCRIPTOR.fields_by_name))

    def __eq__(self, other):
        """Equal values: a field set to its default equals one left unset."""
        return type(other) is type(self) and not schema_view.differences(self._message,
                                                                          other._message)

    def __ne__(self, other):
        return not self == other

    __hash__ = None

    def __deepcopy__(self, memo):
        copy = type(self).__new__(type(self))
        message = self._message_class()
        message.CopyFrom(self._message)
        object.__setattr__(copy, "_message", message)
        return copy

    def __str__(self):
        changed = schema_view.differences(self._message, self._message_class())
        name = type(self).__name__
        if not changed:
            return f"{name}: all defaults"
        width = max(len(path) for path, _ in changed)
        lines = [f"  {path:<{width}} = {value!r}" for path, value in changed]
        return f"{name}: defaults, except\n" + "\n".join(lines)

    __repr__ = __str__


class BuildStrategy(_MessageObject):
    """Graph-building switches (op fusion, in-place reuse); the fields of Fleet's BuildStrategy.

    ``nccl_comm_num`` (an attribute of Paddle's static ``BuildStrategy``) is the strategy's
    field of that name: ``strategy.build_strategy.nccl_comm_num = 2`` sets it, and a
    ``BuildStrategy`` of its own keeps the value until it is assigned to a strategy's
    ``build_strategy``."""

    _message_class = schema.BuildStrategy
    _strategy = None          # the strategy whose build_strategy this object is a view of
    _nccl_comm_num = None     # the value given to an object of its own

    def _extra_names(self):
        return ("nccl_comm_num",)

    def __getattr__(self, name):
        if name != "nccl_comm_num":
            return super().__getattr__(name)
        if self._strategy is not None:
            return self._strategy.nccl_comm_num
        return _NCCL_COMM_NUM.default_value if self._nccl_comm_num is None \
            else self._nccl_comm_num

    def __setattr__(self, name, value):
        if name != "nccl_comm_num":
            super().__setattr__(name, value)
        elif self._strategy is not None:
            self._strategy.nccl_comm_num = value
        else:
            object.__setattr__(self, "_nccl_comm_num", schema_view.coerce(
                _NCCL_COMM_NUM, value, "BuildStrategy.nccl_comm_num"))


class ExecutionStrategy(_MessageObject):
    """Executor settings (threads, scope dropping); the fields of Fleet's ExecutionStrategy."""

    _message_class = schema.ExecutionStrategy


_NCCL_COMM_NUM = schema.DistributedStrategy.DESCRIPTOR.fields_by_name["nccl_comm_num"]

# The seeds' collective-training guide also sets these on the strategy itself; they are
# names for fields of build_strategy and execution_strategy, not fields of their own.
SHORTCUTS = dict(
    {name: ("build_strategy", name) for name in schema.BuildStrategy.DESCRIPTOR.fields_by_name},
    thread_num=("execution_strategy", "num_threads"),
)


class _PaddleOnlyKeys:
    """The keys of a ``*_configs`` message that Paddle's message has and fleetmpi's lacks
    (``pipeline_configs["p2p_cache_shape"]``), for ``schema_view.ConfigView``: kept by the
    strategy and reported, as a loaded file's are."""

    def __init__(self, strategy, name, keys):
        self.strategy, self.prefix, self.names = strategy, name + ".", keys

    def get(self, key):
        return paddle_values.value_of(self.strategy._paddle_only.get(self.prefix + key))

    def rendered(self, values):
        return {self.prefix + key: [paddle_values.render(self.prefix + key, value)]
                for key, value in values.items()}

    def keep(self, texts):
        self.strategy._keep(texts)


class DistributedStrategy(_MessageObject):
    """What a distributed training job should do: Fleet's strategy fields, configs and defaults.

    ``strategy.amp = True``; ``strategy.amp_configs = {"init_loss_scaling": 128}`` changes only
    the keys given (``strategy.amp_configs["incr_ratio"] = 3.0`` works too);
    ``strategy.build_strategy`` and ``strategy.execution_strategy`` are live objects, and
    can be assigned a ``BuildStrategy``/``ExecutionStrategy`` or a dict of their fields.
    Paddle 2.1-2.4's fields that fleetmpi lacks (``fuse_grad_size_in_num``,
    ``pipeline_configs["p2p_cache_shape"]``, ...: ``fleetmpi.config.paddle_fields``) are kept as a
    loaded file's are, and reported as not applied with the reason.
    """

    _message_class = schema.DistributedStrategy
    _sub_objects = {"build_strategy": BuildStrategy, "execution_strategy": ExecutionStrategy}

    def _extra_names(self):
        return tuple(SHORTCUTS) + tuple(paddle_values.names_under(""))

    def __getattr__(self, name):
        if name in SHORTCUTS:
            owner, field = SHORTCUTS[name]
            return getattr(getattr(self, owner), field)
        if name in PADDLE_ONLY:
            return paddle_values.value_of(self._paddle_only.get(name))
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        if name in SHORTCUTS:
            owner, field = SHORTCUTS[name]
            setattr(getattr(self, owner), field, value)
        elif name in PADDLE_ONLY:
            self._keep({name: [paddle_values.render(name, value)]})
        else:
            super().__setattr__(name, value)

    def _present(self, field):
        keys = paddle_values.names_under(field.name + ".")
        if field.name == "build_strategy":
            view = super()._present(field)
            object.__setattr__(view, "_strategy", self)
            return view
        if field.name in self._sub_objects or not keys:
            return super()._present(field)
        return schema_view.ConfigView(getattr(self._message, field.name), field.name,
                                      _PaddleOnlyKeys(self, field.name, keys))

    def _assign_message(self, field, value):
        super()._assign_message(field, value)
        if isinstance(value, BuildStrategy) and value._nccl_comm_num is not None:
            self.nccl_comm_num = value._nccl_comm_num

    def _keep(self, texts):
        """Keep Paddle-only fields, ``{dotted path: [text]}``
        (``fleetmpi.config.paddle_values``)."""
        object.__setattr__(self, "_paddle_only",
                           types.MappingProxyType(dict(self._paddle_only, **texts)))

    # Fields of Paddle's message that fleetmpi does not have, as a loaded file held them
    # (``fleetmpi.config.prototxt``) or the script set them (``fleetmpi.config.paddle_values``);
    # written back
    # by save_to_prototxt.
    _paddle_only = types.MappingProxyType({})

    def paddle_only_fields(self):
        """``{dotted path: [text]}`` of the fields of Paddle's message, absent from fleetmpi's,
        that the loaded file set (``fleetmpi.config.paddle_fields``); they change nothing here."""
        return {path: list(texts) for path, texts in self._paddle_only.items()}

    def __eq__(self, other):
        return super().__eq__(other) and paddle_values.values(self._paddle_only) == \
            paddle_values.values(other._paddle_only)

    __hash__ = None

    def __deepcopy__(self, memo):
        copy = super().__deepcopy__(memo)
        object.__setattr__(copy, "_paddle_only", self._paddle_only)
        return copy

    def save_to_prototxt(self, output):
        """Write the fields that were set (proto2 presence, as Paddle writes them), and the
        Paddle-only fields a loaded file held, to ``output`` in protobuf text format."""
        text = prototxt.render(self._message, self._paddle_only).encode("utf-8")
        write_atomically(output, lambda f: f.write(text))

    def load_from_prototxt(self, pb_file):
        """Replace this strategy by the one in ``pb_file`` (fields it omits take their
        defaults) and return it. Files Paddle 2.0-2.2 wrote load too: their fields that
        fleetmpi does not have are kept and reported as not applied
        (``fleetmpi.config.paddle_fields``). A malformed file changes nothing and raises a
        ConfigError naming the file and line; so does one of fleetmpi's cut short, which a
        save never leaves (it writes a temporary and renames it)."""
        text = _read_text(pb_file)
        try:
            message, paddle_only = prototxt.parse(text, self._message_class)
        except text_format.ParseError as exc:
            line, column = exc.GetLine(), exc.GetColumn()
            where = f"{pb_file}:{line}:{column}" if line else str(pb_file)
            reason = str(exc).split(" : ", 1)[-1]
            raise schema_view.ConfigError(f"{where}: {reason}") from None
        except prototxt.UnknownFieldInFile as exc:
            raise schema_view.ConfigError(f"{pb_file}:{exc.line}:{exc.column}: {exc}") from None
        except prototxt.IncompleteFile as exc:
            raise schema_view.ConfigError(f"{os.fspath(pb_file)}: {exc}") from None
        try:
            schema_view.validate(message)
        except (schema_view.ConfigError, TypeError) as exc:
            raise schema_view.ConfigError(f"{os.fspath(pb_file)}: {exc}") from None
        self._message.CopyFrom(message)
        object.__setattr__(self, "_paddle_only", types.MappingProxyType(paddle_only))
        return self
