"""Paddle-only strategy fields set from Python (``strategy.fuse_grad_size_in_num = 4``,
``strategy.pipeline_configs["p2p_cache_shape"] = False``), kept as the text a strategy file holds.

A strategy keeps the Paddle-only fields (``fleetmpi.config.paddle_fields.PADDLE_ONLY``) a loaded
file held as ``{dotted path: [text of each occurrence]}``; a field set from Python joins them in the
same form, so ``save_to_prototxt`` writes it, ``paddle_only_fields()`` and
``applied_strategy().not_applied`` report it with the reason it changes nothing, and reading
it gives back the value set. Values are what Paddle's message holds there: numbers, booleans,
strings, lists of them, and for a message field (``trainer_desc_configs``) a dict of them.
"""
from google.protobuf import text_encoding, text_format

from .paddle_fields import PADDLE_ONLY


def names_under(prefix):
    """The Paddle-only names directly under ``prefix`` (``""``: the top level,
    ``"pipeline_configs."``: that message's keys)."""
    return [path[len(prefix):] for path in PADDLE_ONLY
            if path.startswith(prefix) and "." not in path[len(prefix):]]


def _scalar_text(path, value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + text_encoding.CEscape(value, as_utf8=True) + '"'
    raise ValueError(f"{path} = {value!r}: Paddle's field holds a number, a boolean, a string "
                     "or a list of them")


def _value_text(path, value):
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar_text(path, v) for v in value) + "]"
    return _scalar_text(path, value)


def render(path, value):
    """The text of field ``path`` holding ``value``, named by its last part, as a file holds
    it (``fuse_grad_size_in_num: 4``, ``trainer_desc_configs { dump_param: ["w"] }``)."""
    name = path.rpartition(".")[2]
    if isinstance(value, dict):
        body = " ".join(f"{key}: {_value_text(f'{path}[{key!r}]', item)}"
                        for key, item in value.items())
        return f"{name} {{ {body} }}"
    return f"{name}: {_value_text(path, value)}"


def _read_value(tokenizer):
    if tokenizer.TryConsume("["):
        items = []
        while not tokenizer.TryConsume("]"):
            items.append(_read_value(tokenizer))
            tokenizer.TryConsume(",")
        return items
    if tokenizer.token.startswith(("'", '"')):
        return tokenizer.ConsumeString()
    token = tokenizer.token
    tokenizer.NextToken()
    if token in ("true", "True", "false", "False"):
        return token in ("true", "True")
    for kind in (int, float):
        try:
            return kind(token)
        except ValueError:
            pass
    return token


def _read_field(text):
    tokenizer = text_format.Tokenizer([text])
    tokenizer.NextToken()                      # the field's name
    tokenizer.TryConsume(":")
    if tokenizer.token not in ("{", "<"):
        return _read_value(tokenizer)
    closing = "}" if tokenizer.TryConsume("{") else ">"
    tokenizer.TryConsume("<")
    fields = {}
    while not tokenizer.TryConsume(closing):
        key = tokenizer.token
        tokenizer.NextToken()
        tokenizer.TryConsume(":")
        value = _read_value(tokenizer)
        if key in fields:                      # a repeated key written once per element
            earlier = fields[key] if isinstance(fields[key], list) else [fields[key]]
            value = earlier + (value if isinstance(value, list) else [value])
        fields[key] = value
        tokenizer.TryConsume(",")
    return fields


def value_of(texts):
    """The value of a field from its texts: None when unset, a list when it occurred more than
    once (a repeated field of a loaded file)."""
    if not texts:
        return None
    values = [_read_field(text) for text in texts]
    return values[0] if len(values) == 1 else values


def values(kept):
    """``{dotted path: value}`` of kept fields ``{dotted path: [text]}``: equal for equal values
    however the texts are spelt."""
    return {path: value_of(texts) for path, texts in kept.items()}
