"""The one-line quotes of an exception that logs and command-line errors print."""

from __future__ import annotations

from cost_model.errors import SMPConfigError, first_line, one_line


def test_first_line_quotes_the_message_s_first_line_within_the_limit() -> None:
    exc = ValueError("  the rule broke\n  Traceback of the inner call ...\n")
    assert first_line(exc) == "the rule broke"
    assert first_line(exc, 8) == "the rule"


def test_an_exception_that_says_nothing_is_named_by_its_type() -> None:
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError("\n \n")) == "RuntimeError"
    assert one_line(KeyError()) == "KeyError"


def test_one_line_names_the_type_before_the_message() -> None:
    exc = SMPConfigError.build("pipeline_parallel_degree must divide the world", 3)
    assert one_line(exc) == ("SMPConfigError: pipeline_parallel_degree must divide the "
                             "world (got 3)")
    assert one_line(ValueError("x" * 500), 10) == "ValueError: " + "x" * 10
