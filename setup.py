"""The build's entry point (the metadata is in setup.cfg). It refuses a Python older than
setup.cfg's ``python_requires`` first, with one line saying so: pip prepares a local
project's metadata before it resolves anything, but pip before 24 then resolves the
dependencies before it reads ``Requires-Python``, and on Python 3.9 it ended with "No matching
distribution found for protobuf>=7.35.1" after listing some 300 versions. Written for old
Pythons (no newer syntax), and it imports setuptools only after the check.
"""
import configparser
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def required_python(path=os.path.join(HERE, "setup.cfg")):
    """``(">=3.10", (3, 10))`` from setup.cfg's ``python_requires``."""
    config = configparser.ConfigParser()
    config.read(path)
    text = config["options"]["python_requires"].strip()
    if not text.startswith(">="):
        raise ValueError("setup.cfg: python_requires must be '>=X.Y', not " + repr(text))
    return text, tuple(int(part) for part in text[2:].split("."))


def python_refusal(version_info, version_text):
    """The one line refusing this Python, or None where it is new enough."""
    text, minimum = required_python()
    if tuple(version_info[:len(minimum)]) >= minimum:
        return None
    return ("fleetmpi requires Python {} (this is Python {}): make the virtual environment "
            "with a newer python, e.g. python3.12 -m venv .venv".format(
                text.replace(">=", ">= "), version_text))


if __name__ == "__main__":
    refusal = python_refusal(sys.version_info, platform.python_version())
    if refusal:
        sys.exit(refusal)
    from setuptools import setup

    setup()
