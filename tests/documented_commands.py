"""The command lines the documentation gives, each as the argument vector of the program it
runs: README.md, docs/*.md (fenced shell blocks and inline code), the examples' docstrings and
the Slurm example's comments. tests/test_documented_commands.py parses every one against its
program (tests/dry_parse.py).

Notation the documents use, and what it becomes here: ``[--amp]`` and ``[mpiexec -n 2]`` (an
optional part) are kept, ``[options]`` and ``[script arguments]`` (a description) dropped;
``mlp|gpt`` gives one command per alternative; ``<commit of the tree>`` is one placeholder
token, and so is a metavar as ``--help`` shows it (``--gradient-merge K``), which the dry parse
accepts for that option only; ``a && b`` is two commands; ``\\`` continues a line.
"""
import ast
import glob
import itertools
import os
import re
import shlex
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND_WORDS = ("python", "python3", "mpiexec", "mpirun", "srun", "sbatch", "fleetmpirun",
                 "pip", "tests/run", "cd")
# Launchers: what follows their own options is the program they start.
LAUNCHERS = ("mpiexec", "mpirun", "srun")
PYTHONS = ("python", "python3")
# Files the documents name that a user brings (their training script, a host file): nothing
# of ours to parse, and a stand-in with this text where fleetmpirun checks them.
STAND_INS = {"train.py": "", "script.py": "", "ps_train.py": "", "probe.py": "",
             "hosts": "h1:8\nh2:8\n"}
_STARTS = re.compile(r"^(\$ )?([A-Z_]+=\S+ +)*\[?(" + "|".join(re.escape(w) for w in COMMAND_WORDS)
                      + r")(\s|$)")
_OPTIONAL = re.compile(r"(?<!\S)\[([^\[\]]+)\](?!\S)")
_ANGLE = re.compile(r"(?<!\S)<([^<>]+)>(?!\S)")


@dataclass(frozen=True)
class Command:
    """One documented command: where it is written, and its words after the notation above."""
    source: str
    line: int
    text: str
    argv: tuple
    inline: bool  # an inline code span, which may mention an option without the rest

    def __str__(self):
        return f"{self.source}:{self.line}: {shlex.join(self.argv)}"


def sources():
    """``(path relative to the root, lines)`` of every document with command lines; a Python
    example contributes its module docstring, the Slurm example its comments and commands."""
    found = []
    for path in ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT))]:
        with open(os.path.join(ROOT, path)) as f:
            found.append((path, markdown_lines(f.read())))
    for path in sorted(glob.glob("examples/*.py", root_dir=ROOT)):
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        docstring = ast.get_docstring(tree, clean=False) or ""
        # the docstring starts on the file's first line, after the opening quotes
        found.append((path, _indented(enumerate(docstring.splitlines(), 1))))
    for path in sorted(glob.glob("examples/**/*.sbatch", root_dir=ROOT, recursive=True)):
        with open(os.path.join(ROOT, path)) as f:
            numbered = list(enumerate(f.read().splitlines(), 1))
        comments = [(n, line[1:]) for n, line in numbered if line.startswith("# ")]
        code = [(n, line, False) for n, line in numbered if line.strip() and line[0] != "#"]
        found.append((path, _indented(comments) + code))
    return found


def _indented(numbered_lines):
    """The lines indented by four spaces or more: the commands of a docstring or a comment,
    not its prose."""
    return [(number, line, False) for number, line in numbered_lines
            if line.startswith("    ")]


def markdown_lines(text):
    """``(line number, text, inline)`` of the lines a reader may type: every line of a fenced
    or indented block that is not Python, and every inline code span of two words or more (one
    word is a name: `fleetmpirun`), spans across a line break included."""
    lines, fence, prose = [], None, []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "text")
            continue
        if fence is None:
            prose.append((number, line))
            if line.startswith("    "):  # an indented code block
                lines.append((number, line, False))
        elif fence not in ("python", "py", "proto", "protobuf", "json", "yaml", "toml"):
            lines.append((number, line, False))
    return lines + _inline_spans(prose)


def _inline_spans(prose):
    """``(line number, span, True)`` of the inline code spans of two words or more in ``prose``."""
    joined, starts = "", []
    for number, line in prose:
        starts.append((len(joined), number))
        joined += line + "\n"
    found = []
    for match in re.finditer(r"`([^`]+)`", joined):
        span = " ".join(match.group(1).split())
        if " " in span:
            number = max(n for offset, n in starts if offset <= match.start())
            found.append((number, span, True))
    return found


def command_texts(lines):
    """``(line number, text, inline)`` of each command among ``lines``: those that start with
    a command word (or ``$`` and one), with ``\\`` continuations joined."""
    found, pending = [], None
    for number, line, inline in lines:
        text = line.strip()
        if pending is not None:
            pending = (pending[0], pending[1] + " " + text.rstrip("\\").strip(), inline)
            if not text.endswith("\\"):
                found.append(pending)
                pending = None
            continue
        if not _STARTS.match(text):
            continue
        text = text[2:] if text.startswith("$ ") else text
        if text.endswith("\\"):
            pending = (number, text.rstrip("\\").strip(), inline)
        else:
            found.append((number, text, inline))
    return found + ([pending] if pending else [])


def _keep_optional(match):
    """An optional part in brackets: kept when it holds options or a launcher, dropped when it
    describes (``[options]``)."""
    inner = match.group(1).strip()
    return inner if inner.startswith("-") or inner.split()[0] in COMMAND_WORDS else ""


def argvs(text):
    """The argument vectors one documented command line stands for (see the module
    docstring)."""
    text = _ANGLE.sub(lambda m: "<" + re.sub(r"\s+", "_", m.group(1)) + ">", text)
    text = _OPTIONAL.sub(_keep_optional, text)
    words = shlex.split(text, comments=True)
    vectors, current = [], []
    for word in words + ["&&"]:
        if word in ("&&", ";"):
            vectors.append(current)
            current = []
        elif word not in ("...", "$@"):
            current.append(word)
    expanded = []
    for vector in vectors:
        while vector and re.fullmatch(r"[A-Z_]+=\S*", vector[0]):
            vector = vector[1:]  # FLEETMPI_DEVICE=gpu mpiexec ...
        if not vector or vector[0] == "cd":
            continue
        choices = [w.split("|") if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", w) else [w]
                   for w in vector]
        expanded.extend(tuple(c) for c in itertools.product(*choices))
    return expanded


def documented_commands():
    """Every documented command, in document order, then each option an example's docstring
    names in its prose (``--val-every``), as a mention of that example's option."""
    return [Command(path, number, text, argv, inline) for path, lines in sources()
            for number, text, inline in command_texts(lines) for argv in argvs(text)] \
        + option_mentions()


def option_mentions():
    """``python examples/x.py --option`` for each ``--option`` in the prose of an example's
    docstring (its indented command lines are commands)."""
    found = []
    for path in sorted(glob.glob("examples/*.py", root_dir=ROOT)):
        with open(os.path.join(ROOT, path)) as f:
            docstring = ast.get_docstring(ast.parse(f.read()), clean=False) or ""
        prose = [(n, line) for n, line in enumerate(docstring.splitlines(), 1)
                 if not line.startswith("    ")]
        found.extend(Command(path, number, option, ("python", path, option), True)
                     for number, line in prose
                     for option in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", line))
    return found


def program_calls(argv):
    """What ``argv`` asks of this repository's programs, as calls of tests/dry_parse.py:
    ``{"program": kind, "target": ..., "args": [...]}`` (kinds ``script``, ``module``,
    ``fleetmpirun``, ``pytest``; a Slurm script is its ``srun`` line, ``sbatch --wrap`` its
    command, ``fleetmpirun`` of one of our scripts two calls), or ``{"program": "extras",
    "extras": [...]}`` for a ``pip install`` of fleetmpi's extras. ``[]`` when there is
    nothing of ours to parse: a launcher's own command (``mpiexec --version``), pip on other
    packages, the user's own script (``python train.py``)."""
    argv = _without_launcher(argv)
    if not argv:
        return []
    head, rest = argv[0], list(argv[1:])
    if head == "pip":
        extras = [e for w in rest for m in [re.fullmatch(r"(?:\.|fleetmpi)\[(.+)\]", w)] if m
                  for e in m.group(1).split(",")]
        return [{"program": "extras", "extras": extras}] if extras else []
    if head == "sbatch":
        return _sbatch(rest)
    if head == "tests/run":
        return [{"program": "pytest", "target": "tests/run", "args": rest}]
    if head == "fleetmpirun":
        return _fleetmpirun(rest)
    return _python(rest) if head in PYTHONS else []


def _without_launcher(argv):
    """The program part of ``argv``: what a launcher (``mpiexec -n 2``, ``srun --mpi=pmi2``)
    starts, from the first Python, ``fleetmpirun`` or script on; ``()`` when the launcher
    starts nothing (``mpiexec --version``)."""
    if not argv or argv[0] not in LAUNCHERS:
        return tuple(argv)
    for index, word in enumerate(argv[1:], 1):
        if word in PYTHONS or word == "fleetmpirun" or word.endswith(".py"):
            return tuple(argv[index:])
    return ()


def _python(rest):
    if rest[:1] == ["-m"]:
        module, args = rest[1], rest[2:]
        if module == "pytest":
            return [{"program": "pytest", "target": "pytest", "args": args}]
        if module == "fleetmpi.launch":
            return _fleetmpirun(args)
        return [{"program": "module", "target": module, "args": args}]
    if not rest or rest[0] == "-c" or rest[0] in STAND_INS:
        return []
    return [{"program": "script", "target": rest[0], "args": rest[1:]}]


def _fleetmpirun(rest):
    """fleetmpirun's own options, and the script it starts where that is one of ours."""
    call = {"program": "fleetmpirun", "target": "fleetmpirun", "args": rest}
    script = next((i for i, w in enumerate(rest) if w.endswith(".py")), None)
    if script is None or rest[script] in STAND_INS:
        return [call]
    return [call, {"program": "script", "target": rest[script], "args": rest[script + 1:]}]


def _sbatch(rest):
    """``sbatch --wrap "command"``: the command; ``sbatch ours.sbatch args``: the script's
    ``srun`` line with ``"$@"`` standing for ``args``."""
    if "--wrap" in rest:
        return [call for argv in argvs(rest[rest.index("--wrap") + 1])
                for call in program_calls(argv)]
    script = next((w for w in rest if w.endswith(".sbatch")), None)
    if script is None:
        return []
    with open(os.path.join(ROOT, script)) as f:
        srun = [line for line in f if line.startswith("srun ")][-1]
    [argv] = argvs(srun.replace('"$@"', shlex.join(rest[rest.index(script) + 1:])))
    return program_calls(argv)
