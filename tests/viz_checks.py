"""What every picture test shares: a picture that warns fails, and a figure's texts.

Imported by the tests/test_viz*.py files (`from viz_checks import no_warnings, texts`):
importing the autouse fixture is what turns it on in that file.
"""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture(autouse=True)
def no_warnings():
    """What matplotlib warns with (user, deprecation and future warnings) fails the test."""
    with warnings.catch_warnings():
        for category in (UserWarning, DeprecationWarning, FutureWarning):
            warnings.simplefilter("error", category)
        yield


def texts(fig) -> list[str]:
    """Every text drawn on the figure's first axes, in drawing order."""
    return [t.get_text() for t in fig.axes[0].texts]
