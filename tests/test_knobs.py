"""Seconds from environment variables: defaults, the zero rule, and errors naming the value."""
import pytest

from fleetmpi.knobs import env_seconds


def test_unset_or_empty_keeps_the_default():
    assert env_seconds("T", 5.0, environ={}) == 5.0
    assert env_seconds("T", 5.0, environ={"T": ""}) == 5.0


def test_a_number_of_seconds_is_read():
    assert env_seconds("T", 5.0, environ={"T": "0.25"}) == 0.25


def test_zero_only_where_it_means_something():
    assert env_seconds("T", 5.0, zero_means="no limit", environ={"T": "0"}) == 0.0
    with pytest.raises(ValueError, match=r"T='0' must be a positive number of seconds"):
        env_seconds("T", 5.0, environ={"T": "0"})


@pytest.mark.parametrize("text", ["-1", "soon", "inf", "nan"])
def test_bad_values_are_named_with_the_rule_and_default(text):
    with pytest.raises(ValueError, match=rf"T='{text}' must be a number of seconds >= 0 "
                                         r"\(0: no limit; unset: 5\)"):
        env_seconds("T", 5.0, zero_means="no limit", environ={"T": text})
