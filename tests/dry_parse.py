"""Parse command lines against this repository's programs without running them.

    python tests/dry_parse.py < calls.json > verdicts.json

Each call (tests/documented_commands.py, ``program_call``) is ``{"program": kind, "target":
..., "args": [...], "fragment": bool}``. A ``script`` (a path) or ``module`` (``python -m``)
runs as ``__main__`` with ``argparse`` patched so that its first complete parse stops it
(``Parsed``) and an error ends it (``Refused``, the message argparse would print); a
placeholder (the option's metavar as ``--help`` shows it, or ``<...>``) is accepted as that
option's value. ``fleetmpirun`` runs its own ``--dry-run`` (it prints the command it would
start and checks what it can without starting it; with ``--slurm``, which needs an allocation
and srun, only its parse); ``pytest`` parses its command line and
stops before collecting; ``extras`` checks the names against setup.cfg. A ``fragment`` (an
inline mention such as ``fleetmpirun --elastic``) may lack its script and an option's value,
not name an option the program lacks.
Writes one ``{"ok": bool, "message": str}`` per call.
"""
import argparse
import configparser
import contextlib
import io
import json
import os
import re
import runpy
import sys
import tempfile

from documented_commands import STAND_INS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# argparse's messages for what a mention in prose leaves out
FRAGMENT_ERRORS = ("the following arguments are required", "expected one argument")


class Parsed(Exception):
    """The program's command line parsed; the program stops here."""


class Refused(Exception):
    """argparse refused the command line (its message)."""


class Placeholder(str):
    """A documented placeholder standing for an option's value."""


def _is_placeholder(action, word):
    shown = action.metavar or action.dest.upper()  # as --help shows it (positionals: either case)
    names = shown if isinstance(shown, tuple) else (shown,)
    return word in names or (word.startswith("<") and word.endswith(">"))


def _known(parser, word):
    """Whether ``word`` is no option (a value) or one of ``parser``'s options."""
    option = re.fullmatch(r"(--?[A-Za-z][\w-]*)(=.*)?", word)
    return option is None or option.group(1) in parser._option_string_actions


@contextlib.contextmanager
def patched_argparse(stop_at_parse, fragment=None):
    """argparse that raises ``Refused`` instead of exiting, accepts placeholders, and (with
    ``stop_at_parse``) raises ``Parsed`` after the program's outermost parse. ``fragment``:
    the words of a mention in prose, which passes (``Parsed``) when it only leaves out a
    required argument or an option's value and names no option the parser lacks."""
    cls = argparse.ArgumentParser
    saved = {name: getattr(cls, name) for name in
             ("error", "exit", "parse_args", "parse_known_args", "_get_value", "_check_value")}
    depth = [0]

    def outermost(name):
        def call(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = saved[name](self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if stop_at_parse and depth[0] == 0:
                raise Parsed()
            return result
        return call

    def exit_(self, status=0, message=None):
        raise Refused(message or f"exit {status}")

    def error(self, message):
        if fragment is not None and any(e in message for e in FRAGMENT_ERRORS) \
                and all(_known(self, word) for word in fragment):
            raise Parsed()
        raise Refused(message)

    cls.error = error
    cls.exit = exit_
    cls.parse_args, cls.parse_known_args = outermost("parse_args"), outermost("parse_known_args")
    cls._get_value = lambda self, action, word: (
        Placeholder(word) if _is_placeholder(action, word) else saved["_get_value"](self, action,
                                                                                   word))
    cls._check_value = lambda self, action, value: (
        None if isinstance(value, Placeholder) else saved["_check_value"](self, action, value))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cls, name, value)


def run_program(call):
    """Run a ``script`` or ``module`` call until its parse; ``(ok, message)``."""
    target, args = call["target"], call["args"]
    path = os.path.join(ROOT, target)
    if call["program"] == "script" and not os.path.isfile(path):
        return False, f"{target}: no such file"
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        with patched_argparse(True, call["args"] if call.get("fragment") else None):
            if call["program"] == "script":
                sys.argv = [path, *args]
                sys.path.insert(0, os.path.dirname(path))
                runpy.run_path(path, run_name="__main__")
            else:
                sys.argv = [target, *args]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except Parsed:
        return True, "parsed"
    except Refused as refused:
        return False, str(refused)
    except SystemExit as ended:
        return False, f"exited {ended.code} before parsing its arguments"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return not args, "ran to its end without parsing arguments" + (
        " (it takes none)" if not args else f", so {args} were ignored")


def run_fleetmpirun(call):
    """fleetmpirun's ``--dry-run``, the user's files of the command (``train.py``, ``hosts``)
    made as stand-ins."""
    from fleetmpi.launch import fleetmpirun

    args = call["args"] if "--dry-run" in call["args"] else ["--dry-run", *call["args"]]
    with tempfile.TemporaryDirectory() as folder:
        for name, text in STAND_INS.items():
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
        args = [os.path.join(folder, w) if w in STAND_INS else w for w in args]
        # --slurm's dry run asks srun and the allocation, which a test machine lacks: its
        # command line is parsed only
        slurm = "--slurm" in args
        try:
            with patched_argparse(slurm, args if call.get("fragment") else None):
                code = fleetmpirun.main(args)
        except Parsed:
            return True, "parsed"
        except Refused as refused:
            return False, str(refused)
    return code == 0, f"--dry-run exited {code}"


def run_pytest(call):
    import pytest

    if call["target"] == "tests/run" and not os.access(os.path.join(ROOT, "tests", "run"),
                                                        os.X_OK):
        return False, "tests/run is not an executable file"

    class ParseOnly:
        @pytest.hookimpl(tryfirst=True)
        def pytest_cmdline_main(self, config):
            return 0  # the command line parsed: stop before collecting

    code = pytest.main(["-p", "no:cacheprovider", *call["args"]], plugins=[ParseOnly()])
    return code == 0, f"pytest exited {code}"


def check_extras(call):
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    unknown = set(call["extras"]) - set(config["options.extras_require"])
    return not unknown, f"unknown extras: {sorted(unknown)}" if unknown else "extras exist"


RUNNERS = {"script": run_program, "module": run_program, "fleetmpirun": run_fleetmpirun,
           "pytest": run_pytest, "extras": check_extras}


def verdict(call):
    """``{"ok", "message"}`` of one call, its output kept out of this program's."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        ok, message = RUNNERS[call["program"]](call)
    return {"ok": ok, "message": message}


def main():
    calls = json.load(sys.stdin)
    verdicts = [verdict(call) for call in calls]
    json.dump(verdicts, sys.stdout)


if __name__ == "__main__":
    main()
