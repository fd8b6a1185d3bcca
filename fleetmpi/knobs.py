"""Seconds read from environment variables, with one rule and one error message everywhere.

Each behaviour with a time limit has one variable (``FLEETMPI_STALL_TIMEOUT``,
``FLEETMPI_PS_TIMEOUT``, ...): unset or empty keeps the default, anything else must be a finite
number of seconds, and a bad value is refused naming the variable, the value and the rule.
"""
import math
import os


def env_seconds(name, default, zero_means=None, environ=os.environ):
    """The seconds in variable ``name``, ``default`` when it is unset or empty.

    The value must be a finite number > 0, or >= 0 when ``zero_means`` says what 0 stands for
    (the caller then handles 0 itself)."""
    text = environ.get(name, "")
    if text == "":
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    zero_allowed = zero_means is not None
    if math.isinf(seconds) or not (seconds > 0 or zero_allowed and seconds == 0):
        rule = (f"a number of seconds >= 0 (0: {zero_means}" if zero_allowed
                else "a positive number of seconds (")
        raise ValueError(f"{name}={text!r} must be {rule}; unset: {default:g})")
    return seconds
