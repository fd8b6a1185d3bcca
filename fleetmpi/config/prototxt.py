"""Strategy files in protobuf text format, read and written as Paddle's are.

Writing: only the fields that hold a value (proto2 presence), so a file that uses Paddle's
fields alone loads into Paddle's own message. Reading: a file Paddle 2.0-2.2 wrote, whose
fields fleetmpi does not have (``fleetmpi.config.paddle_fields.PADDLE_ONLY``) are kept as written,
as ``{dotted path: [text of each occurrence]}``, and written back after the fields of the message.

A file fleetmpi writes opens with ``HEADER`` and closes with ``TRAILER`` (comments to protobuf
and to Paddle): text format has no end marker of its own, so a file cut short at a line or
inside a number would otherwise parse as another strategy (amp lost, a ratio changed). A file
that opens with the header must close with the trailer; Paddle's files and hand-written ones,
which have neither, load as they are.
"""

from google.protobuf import text_format

from .paddle_fields import PADDLE_ONLY
from .suggest import did_you_mean

_CLOSE = {"{": "}", "<": ">"}
HEADER = "# fleetmpi DistributedStrategy\n"
TRAILER = "# end of fleetmpi DistributedStrategy\n"


class IncompleteFile(ValueError):
    """A file that opens as fleetmpi writes one but does not close with ``TRAILER``."""


class UnknownFieldInFile(ValueError):
    """A name in a file that is neither a field of the schema nor a field of Paddle's."""

    def __init__(self, message, line, column):
        super().__init__(message)
        self.line, self.column = line, column


def _value_tokens(tokenizer):
    """The tokens of one field's value after its name: ``: v``, ``: [a, b]`` or a block."""
    tokens = []
    if tokenizer.TryConsume(":"):
        tokens.append(":")
    if tokenizer.token in _CLOSE:
        depth = 0
        while True:
            token = tokenizer.token
            tokens.append(token)
            tokenizer.NextToken()
            depth += token in _CLOSE
            depth -= token in _CLOSE.values()
            if depth == 0:
                return tokens
            if tokenizer.AtEnd():
                return tokens
    if tokenizer.token == "[":
        while not tokenizer.AtEnd():
            token = tokenizer.token
            tokens.append(token)
            tokenizer.NextToken()
            if token == "]":
                return tokens
        return tokens
    tokens.append(tokenizer.token)
    tokenizer.NextToken()
    while tokenizer.token.startswith(("'", '"')) and tokens[-1].startswith(("'", '"')):
        tokens.append(tokenizer.token)   # adjacent strings are one value
        tokenizer.NextToken()
    return tokens


def _render(name, tokens):
    text = " ".join(tokens)
    return f"{name}{text}" if tokens[0] == ":" else f"{name} {text}"


def _scan(tokenizer, descriptor, prefix, kept):
    while not tokenizer.AtEnd() and tokenizer.token not in _CLOSE.values():
        name = tokenizer.token
        tokenizer.NextToken()
        where = tokenizer.ParseErrorPreviousToken("")
        field = descriptor.fields_by_name.get(name)
        if field is None and prefix + name not in PADDLE_ONLY:
            names = [prefix + n for n in descriptor.fields_by_name] + \
                [path for path in PADDLE_ONLY if path.startswith(prefix)
                 and "." not in path[len(prefix):]]
            raise UnknownFieldInFile(
                f"{prefix}{name} is neither a field of fleetmpi's DistributedStrategy nor one "
                f"of Paddle 2.0-2.2's{did_you_mean(prefix + name, names)}", where.GetLine(),
                where.GetColumn())
        if field is not None and field.message_type is not None:
            tokenizer.TryConsume(":")
            opening = tokenizer.token
            if opening in _CLOSE:
                tokenizer.NextToken()
                _scan(tokenizer, field.message_type, f"{prefix}{name}.", kept)
                tokenizer.TryConsume(_CLOSE[opening])
        else:
            tokens = _value_tokens(tokenizer)
            if field is None:
                kept.setdefault(prefix + name, []).append(_render(name, tokens))
        if not tokenizer.TryConsume(","):
            tokenizer.TryConsume(";")


def paddle_only_fields(text, message_class):
    """``{dotted path: [text]}`` of the Paddle-only fields of ``text``; UnknownFieldInFile
    for a name that is neither. Syntax errors are left to protobuf's parser."""
    kept = {}
    try:
        _scan(text_format.Tokenizer(text.splitlines()), message_class.DESCRIPTOR, "", kept)
    except text_format.ParseError:
        pass
    return kept


def parse(text, message_class):
    """``(message, paddle_only)`` from the text of a file; ``text_format.ParseError`` or
    ``UnknownFieldInFile`` naming the line of a problem, ``IncompleteFile`` for a file of
    fleetmpi's cut short."""
    if text.startswith(HEADER) and not text.endswith(TRAILER):
        raise IncompleteFile(
            f"it opens as fleetmpi writes a strategy ({HEADER.strip()!r}) but does not close "
            f"with {TRAILER.strip()!r}, so it was cut short (a save that did not finish, or a "
            "truncated copy) and nothing was loaded; save the strategy again, or delete the "
            "first line to load what the file holds as it is")
    kept = paddle_only_fields(text, message_class)
    message = message_class()
    text_format.Parse(text, message, allow_unknown_field=True)
    return message, kept


def render(message, paddle_only):
    """The text of a file of ``message`` (fields that hold a value) and the Paddle-only
    fields, between ``HEADER`` and ``TRAILER``."""
    lines = text_format.MessageToString(message).splitlines()
    for path, texts in paddle_only.items():
        parent, _, _ = path.rpartition(".")
        if not parent:
            lines += texts
            continue
        opening = f"{parent} {{"
        if opening not in lines:
            lines += [opening, "}"]
        end = lines.index("}", lines.index(opening))
        lines[end:end] = [f"  {text}" for text in texts]
    return HEADER + "".join(line + "\n" for line in lines) + TRAILER
