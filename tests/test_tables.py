"""ddplab.tables: the one table formatter, and how chapters 9 and 10 print a difference.

The difference's format and nbval's mask for it are one policy in two places (the module
and tests/nbval_sanitize.cfg); the tests hold them to each other.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from ddplab.tables import delta, format_table

SANITIZE = Path(__file__).resolve().parent / "nbval_sanitize.cfg"


def rounding_mask() -> tuple[str, str]:
    config = configparser.ConfigParser()
    config.read(SANITIZE, encoding="utf-8")
    return config["rounding"]["regex"], config["rounding"]["replace"]


def test_a_difference_is_a_number_and_zero_is_zero():
    assert delta(0.0) == "0"
    assert delta(-0.0) == "0"
    assert delta(3.576e-7) == "3.6e-07"
    assert delta(2.5e-4) == "2.5e-04"
    assert delta(1.0) == "1.0e+00"


def test_nbval_masks_rounding_only_below_the_tolerance():
    regex, replace = rounding_mask()
    masked = re.sub(regex, replace, " ".join(delta(d) for d in (0.0, 9.9e-6, 3.6e-7, 2e-12,
                                                                 1e-5, 2.5e-4, 1.0)))
    assert masked == f"0 {replace} {replace} {replace} 1.0e-05 2.5e-04 1.0e+00"


def test_a_table_pads_columns_and_strips_lines():
    text = format_table([["a", "1"], ["bbb", "22"]], header=["x", "n"], rule=True, align="<>")
    assert text.splitlines() == ["x     n", "---  --", "a     1", "bbb  22"]
