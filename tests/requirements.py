"""Skips that cannot hide a missing dependency in CI.

A test that needs transformers, the model file or a TLS-capable redis-server skips on a developer's
machine that lacks it, with the reason; under CI=true (set by .ci/run) the same test fails, since a
skip there would pass a feature nobody checked.
"""

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def skip_unless_ci(reason: str) -> None:
    """Skip, or under CI=true fail, saying what is missing."""
    if in_ci():
        pytest.fail(f"missing in CI (a skip would hide it): {reason}", pytrace=False)
    pytest.skip(reason)


def import_or_skip(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        skip_unless_ci(f"cannot import {module}: {error}")
