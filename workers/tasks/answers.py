"""Reading the answer out of a natural response (``task.answer_format``), and comparing answers.

A chat model rarely answers on a line of its own: it writes "71", "23 + 48 = 71" or "The answer is
71.". Each format is one rule for where the answer stands; :func:`read_answer` gives the answer's
text, or None when the rule finds none (the response is *unreadable*: it scores 0, and counts in
``response/unreadable_fraction``). Worked examples (docs/job-spec.md: answers):

- ``last-number``: the last number in the response. A number is digits with an optional decimal
  part (``3.5``; a trailing point is punctuation: "71." reads 71) and an optional minus sign, which
  counts only where it cannot be a subtraction, i.e. not right after a letter, digit, ``)`` or
  ``.`` ("= -3.5" reads -3.5, "5-3" reads 3). Commas between groups of exactly three digits are
  thousands separators and are dropped ("1,234" reads 1234, "1,234,567" 1234567); any other comma
  separates numbers ("1,2,3" reads 3; so does a decimal comma: "3,5" reads 5). The number's text is
  kept as written otherwise ("071" stays "071").
  "23 + 48 = 71" -> "71"; "The answer is -3.5" -> "-3.5"; "no idea" -> unreadable.
- ``first-line``: the first non-blank line, stripped (the project's original rule); an empty
  response is unreadable. "71\\nbecause ..." -> "71"; "23 + 48 = 71" -> "23 + 48 = 71".
- ``answer-tag``: the text inside the last ``<answer>...</answer>`` (tags in any case), stripped;
  unreadable without a closed pair. "<answer> 4 </answer> then 5" -> "4".
- ``boxed``: the content of the last ``\\boxed{...}`` whose braces balance, stripped; a box cut
  off before its closing brace does not count. "\\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}".
- ``auto``: ``last-number`` when the problem's reference answer is itself a number
  (:func:`parse_number`), ``first-line`` otherwise; decided per problem.

Comparison (a task from a dataset file; reasoning-gym tasks compare with the generator's own
``score_answer``): equal after stripping, or both numbers of the same value, so "71.0", "71" and
"071" all match a reference of 71, and "1,234" matches 1234.
"""

from __future__ import annotations

import re
from decimal import Decimal

from rljob.spec import AnswerFormat

_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)"  # thousands groups, or a plain run of digits
# the sign: only where it cannot be a subtraction (not after a letter, digit, ")" or ".")
_NUMBER = re.compile(rf"(?:(?<![\w).])-)?{_DIGITS}(?:\.\d+)?")
_WHOLE_NUMBER = re.compile(rf"-?{_DIGITS}(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{")
_BRACE_DEPTH = {"{": 1, "}": -1}


def last_number(response: str) -> str | None:
    """The last number in ``response``, thousands separators dropped (module docstring)."""
    found = _NUMBER.findall(response)
    return found[-1].replace(",", "") if found else None


def first_line(response: str) -> str | None:
    """The first non-blank line of ``response``, stripped; None when there is none."""
    line = response.strip().split("\n", 1)[0].strip()
    return line or None


def answer_tag(response: str) -> str | None:
    """The text inside the last ``<answer>...</answer>``, stripped; None without a closed pair."""
    found = _ANSWER_TAG.findall(response)
    return found[-1].strip() if found else None


def boxed(response: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces balance, stripped; None without one."""
    for start in reversed([m.end() for m in _BOXED.finditer(response)]):
        depth = 1
        for i in range(start, len(response)):
            depth += _BRACE_DEPTH.get(response[i], 0)
            if depth == 0:
                return response[start:i].strip()
    return None


_READERS = {"last-number": last_number, "first-line": first_line, "answer-tag": answer_tag, "boxed": boxed}


def parse_number(text: str) -> Decimal | None:
    """The value of ``text`` if the whole of it (stripped) is one number (as :func:`last_number`
    reads them: "-3.5", "1,234", "071"); None otherwise."""
    text = text.strip()
    return Decimal(text.replace(",", "")) if _WHOLE_NUMBER.fullmatch(text) else None


def resolve_format(answer_format: AnswerFormat, reference: str) -> AnswerFormat:
    """The format a problem's responses are read in: ``auto`` made concrete by its reference answer."""
    if answer_format != "auto":
        return answer_format
    return "last-number" if parse_number(reference) is not None else "first-line"


def read_answer(response: str, answer_format: AnswerFormat, reference: str) -> str | None:
    """The answer ``response`` gives in ``answer_format`` (``auto`` decided by ``reference``);
    None when it gives none (unreadable)."""
    return _READERS[resolve_format(answer_format, reference)](response)


def same_answer(answer: str, reference: str) -> bool:
    """Equal after stripping, or numbers of the same value ("71.0" == "71" == "071")."""
    if answer.strip() == reference.strip():
        return True
    a, r = parse_number(answer), parse_number(reference)
    return a is not None and r is not None and a == r
