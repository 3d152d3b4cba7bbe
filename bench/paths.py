"""What every bench script imports first: the package from this checkout when it is not installed, and
the test fakes (fake NVML) from tests/."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
try:
    import verl_exporter  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(REPO / "exporter"))
