"""Tests, laid out like the package; helpers (tiny models, reference runs, the server harness) sit here."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the checkout
