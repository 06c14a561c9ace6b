"""Answers read out of hand-written responses, each expected answer worked out by reading the
response as the format's rule says (workers/answers.py's docstring), not by running the code."""

from __future__ import annotations

from decimal import Decimal

import pytest

from workers.tasks.answers import (
    answer_tag,
    boxed,
    first_line,
    last_number,
    parse_number,
    read_answer,
    resolve_format,
    same_answer,
)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("71", "71"),
        ("23 + 48 = 71", "71"),  # the last of three numbers
        ("The answer is 71.", "71"),  # a trailing point is punctuation, not a decimal part
        ("The answer is -3.5", "-3.5"),  # after a space the minus is a sign
        ("1,234", "1234"),  # a thousands separator is dropped
        ("about 1,234,567 apples", "1234567"),
        ("x = -3", "-3"),
        ("(-3)", "-3"),
        ("5-3", "3"),  # after a digit the minus is a subtraction
        ("5 - 3 = 2\n", "2"),
        ("1,2,3", "3"),  # commas not before three digits separate numbers
        ("3,5", "5"),  # a decimal comma is not read as one (documented)
        ("071", "071"),  # kept as written
        ("\\boxed{12}", "12"),
        ("<answer>42</answer>", "42"),
        ("71\nbecause 23 + 48 = 71.0", "71.0"),
        ("no number at all", None),
        ("", None),
    ],
)
def test_last_number(response: str, answer: str | None) -> None:
    assert last_number(response) == answer


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("71", "71"),
        ("71\nbecause 23 + 48", "71"),
        ("\n\n 7 \n8", "7"),  # blank lines before it do not count
        ("7\r\n8", "7"),
        ("23 + 48 = 71", "23 + 48 = 71"),  # the whole line: no number is picked out of it
        ("The answer is 71.", "The answer is 71."),
        ("", None),
        (" \n ", None),
    ],
)
def test_first_line(response: str, answer: str | None) -> None:
    assert first_line(response) == answer


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("<answer>42</answer>", "42"),
        ("<answer> 4 </answer> then 5", "4"),  # the tag's text, stripped; nothing after it counts
        ("<answer>1</answer> no, wait: <answer>2</answer>", "2"),  # the last pair
        ("<answer>\n12\n</answer>", "12"),
        ("<ANSWER>7</Answer>", "7"),  # tags in any case
        ("<answer>a <answer>b</answer>", "b"),  # the opening nearest the closing
        ("<answer></answer>", ""),  # a tag, empty: readable, and wrong
        ("<answer>7", None),  # cut off before the closing tag
        ("71", None),
        ("", None),
    ],
)
def test_answer_tag(response: str, answer: str | None) -> None:
    assert answer_tag(response) == answer


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("\\boxed{12}", "12"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # braces balanced: the inner ones are content
        ("so \\boxed{1}, or rather \\boxed{2}.", "2"),
        ("\\boxed{3} then \\boxed{\\frac{1}{2", "3"),  # the last box is cut off: the last whole one
        ("\\boxed { 5 }", "5"),
        ("\\boxed{", None),
        ("12", None),
        ("", None),
    ],
)
def test_boxed(response: str, answer: str | None) -> None:
    assert boxed(response) == answer


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("71", Decimal(71)),
        (" -3.5 ", Decimal("-3.5")),
        ("1,234", Decimal(1234)),
        ("71.0", Decimal(71)),
        ("071", Decimal(71)),
        ("1,23", None),
        ("3 + 4", None),
        ("1/2", None),
        ("Paris", None),
        ("", None),
    ],
)
def test_parse_number_reads_a_whole_number_only(text: str, value: Decimal | None) -> None:
    assert parse_number(text) == value


def test_auto_is_last_number_for_a_number_reference_and_first_line_otherwise() -> None:
    assert resolve_format("auto", "71") == "last-number"
    assert resolve_format("auto", "-3.5") == "last-number"
    assert resolve_format("auto", "Paris") == "first-line"
    assert resolve_format("auto", "1/2") == "first-line"
    assert resolve_format("boxed", "71") == "boxed"  # a format named is used as it is
    assert read_answer("The answer is 71.", "auto", "71") == "71"
    assert read_answer("Paris\nis the capital", "auto", "Paris") == "Paris"
    assert read_answer("The answer is 71.", "first-line", "71") == "The answer is 71."


@pytest.mark.parametrize(
    ("answer", "reference", "same"),
    [
        ("71", "71", True),
        ("71.0", "71", True),  # numbers compare by value
        ("071", "71", True),
        ("1234", "1,234", True),
        (" E ", "E", True),  # text compares stripped, exactly
        ("e", "E", False),
        ("72", "71", False),
        ("-71", "71", False),
        ("", "71", False),
    ],
)
def test_same_answer(answer: str, reference: str, same: bool) -> None:
    assert same_answer(answer, reference) is same
