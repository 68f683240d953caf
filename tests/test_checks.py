"""checks.py: every argument check accepts what it should and refuses with "NAME must be RULE, got VALUE"."""

from __future__ import annotations

import math

import pytest

from gpipe_ref.checks import (
    fraction,
    instance,
    integer,
    non_negative,
    number,
    one_of,
    positive,
    positive_int,
    probability,
)

NAN, INF = float("nan"), float("inf")


def refused(check, *args, message: str, **kwargs) -> None:
    with pytest.raises(ValueError) as info:
        check(*args, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("value,minimum", [(0, 0), (7, 0), (-3, -3), (2**70, 1), (1, 1)])
def test_integer_accepts_and_returns_the_value(value, minimum):
    assert integer("n", value, minimum) == value and type(integer("n", value, minimum)) is int


@pytest.mark.parametrize("value,shown", [(-1, "-1"), (True, "True"), (False, "False"), (1.0, "1.0"), (NAN, "nan"),
                                         ("1", "'1'"), (None, "None")])
def test_integer_refuses_below_the_minimum_bools_floats_nan_and_other_types(value, shown):
    refused(integer, "n", value, message=f"n must be an integer >= 0, got {shown}")


def test_integer_boundary_is_the_minimum():
    assert integer("stages", 3, 3) == 3
    refused(integer, "stages", 2, 3, message="stages must be an integer >= 3, got 2")


def test_integer_with_a_maximum_names_the_closed_range():
    assert integer("stage", 0, 0, 3) == 0 and integer("stage", 3, 0, 3) == 3
    refused(integer, "stage", 4, 0, 3, message="stage must be an integer in [0, 3], got 4")
    refused(integer, "stage", -1, 0, 3, message="stage must be an integer in [0, 3], got -1")
    refused(integer, "stage", True, 0, 3, message="stage must be an integer in [0, 3], got True")
    refused(integer, "stage", 1.0, 0, 3, message="stage must be an integer in [0, 3], got 1.0")
    refused(integer, "device", 0, 0, -1, message="device must be an integer in [0, -1], got 0")  # no devices


def test_probability_is_zero_up_to_but_not_one():
    assert probability("p", 0) == 0 and probability("p", 0.5) == 0.5 and probability("p", 0.999) == 0.999
    for value, shown in [(1, "1"), (1.0, "1.0"), (-0.1, "-0.1"), (NAN, "nan"), (True, "True"), ("0.1", "'0.1'")]:
        refused(probability, "p", value, message=f"p must be a number in [0, 1), got {shown}")


def test_instance_names_the_types_wanted_and_the_type_given():
    assert instance("x", 3, int) == 3 and instance("x", None, int, type(None)) is None
    with pytest.raises(TypeError, match=r"^setup must be a dict, got list$"):
        instance("setup", [], dict)
    with pytest.raises(TypeError, match=r"^x must be a int or str, got float$"):
        instance("x", 1.5, int, str)
    with pytest.raises(TypeError, match=r"^cluster must be a dict or None, got int$"):
        instance("cluster", 3, type(None), dict)
    with pytest.raises(TypeError, match="at least one type"):
        instance("x", 3)


def test_positive_int():
    assert positive_int("chunks", 1) == 1 and positive_int("chunks", 64) == 64
    refused(positive_int, "chunks", 0, message="chunks must be an integer >= 1, got 0")
    refused(positive_int, "chunks", -2, message="chunks must be an integer >= 1, got -2")
    refused(positive_int, "chunks", True, message="chunks must be an integer >= 1, got True")
    refused(positive_int, "chunks", 2.0, message="chunks must be an integer >= 1, got 2.0")
    refused(positive_int, "chunks", NAN, message="chunks must be an integer >= 1, got nan")
    refused(positive_int, "chunks", "4", message="chunks must be an integer >= 1, got '4'")


def test_number():
    assert number("x", 0) == 0 and number("x", 2.5) == 2.5 and number("x", 1e308) == 1e308
    assert number("x", INF, finite=False) == INF  # a limit that may be "none"
    refused(number, "x", INF, message="x must be a finite number >= 0, got inf")
    refused(number, "x", -INF, -INF, message="x must be a finite number >= -inf, got -inf")
    refused(number, "x", NAN, finite=False, message="x must be a number >= 0, got nan")
    assert number("x", -1.5, -2) == -1.5 and number("x", 3, 2, strict=True) == 3
    refused(number, "x", -0.1, message="x must be a finite number >= 0, got -0.1")
    refused(number, "x", 2, 2, strict=True, message="x must be a finite number > 2, got 2")
    refused(number, "x", 0.25, 0.5, message="x must be a finite number >= 0.5, got 0.25")
    refused(number, "x", NAN, message="x must be a finite number >= 0, got nan")
    refused(number, "x", True, message="x must be a finite number >= 0, got True")
    refused(number, "x", "1", message="x must be a finite number >= 0, got '1'")
    refused(number, "x", None, message="x must be a finite number >= 0, got None")


def test_non_negative():
    assert non_negative("cost", 0) == 0 and non_negative("cost", 0.0) == 0.0 and non_negative("cost", 3) == 3
    refused(non_negative, "cost", -1e-9, message="cost must be a finite number >= 0, got -1e-09")
    refused(non_negative, "cost", INF, message="cost must be a finite number >= 0, got inf")
    refused(non_negative, "cost", NAN, message="cost must be a finite number >= 0, got nan")
    refused(non_negative, "cost", False, message="cost must be a finite number >= 0, got False")
    refused(non_negative, "cost", [1], message="cost must be a finite number >= 0, got [1]")


def test_positive():
    assert positive("lr", 1e-12) == 1e-12 and positive("lr", 3) == 3
    refused(positive, "lr", 0, message="lr must be a finite number > 0, got 0")
    refused(positive, "lr", 0.0, message="lr must be a finite number > 0, got 0.0")
    refused(positive, "lr", -2, message="lr must be a finite number > 0, got -2")
    refused(positive, "lr", INF, message="lr must be a finite number > 0, got inf")
    refused(positive, "lr", NAN, message="lr must be a finite number > 0, got nan")
    refused(positive, "lr", True, message="lr must be a finite number > 0, got True")
    refused(positive, "lr", "0.1", message="lr must be a finite number > 0, got '0.1'")


def test_fraction():
    assert fraction("efficiency", 1) == 1 and fraction("efficiency", 0.5) == 0.5
    assert fraction("efficiency", math.ulp(0.0)) == math.ulp(0.0)  # (0, 1]: anything above 0
    for bad, shown in [(0, "0"), (0.0, "0.0"), (1.0000001, "1.0000001"), (-0.5, "-0.5"), (NAN, "nan"),
                       (INF, "inf"), (True, "True"), ("0.5", "'0.5'"), (None, "None")]:
        refused(fraction, "efficiency", bad, message=f"efficiency must be a number in (0, 1], got {shown}")


def test_one_of():
    assert one_of("mode", "never", ("always", "never")) == "never"
    assert one_of("backend", None, ["gloo", None]) is None
    assert one_of("mode", "a", iter(["a", "b"])) == "a"  # any iterable, read once
    assert one_of("mode", "b", {"b": 1}) == "b"  # a dict's keys
    refused(one_of, "mode", "sometimes", ("always", "never"),
            message="mode must be one of ('always', 'never'), got 'sometimes'")
    refused(one_of, "mode", "A", ["a"], message="mode must be one of ('a',), got 'A'")  # case matters
    refused(one_of, "mode", ["a"], ("a",), message="mode must be one of ('a',), got ['a']")
    refused(one_of, "mode", ["a"], frozenset({"a"}), message="mode must be one of ('a',), got ['a']")  # unhashable
    refused(one_of, "mode", float("nan"), (NAN,), message="mode must be one of (nan,), got nan")  # NaN equals nothing
    refused(one_of, "mode", "x", (), message="mode must be one of (), got 'x'")
