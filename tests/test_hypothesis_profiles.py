"""The property tests draw the same examples on every run of the default suite, and `-m slow` runs them
with fresh random ones, five times as many (the profiles in tests/conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import settings

from tests.conftest import examples

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_suite_is_derandomized(pytestconfig):
    if os.environ.get("HYPOTHESIS_PROFILE") or "not slow" not in (pytestconfig.option.markexpr or ""):
        return                                           # a run that chose another profile on purpose
    assert settings.get_current_profile_name() == "ci"
    assert settings.default.derandomize and settings.default.database is None and examples(30) == 30


def test_slow_runs_the_property_tests_wide():
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow", "--collect-only",
                          "tests/test_property_lowering.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2 tests collected" in out.stdout, out.stdout[-2000:]
