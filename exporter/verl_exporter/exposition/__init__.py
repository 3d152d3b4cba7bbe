"""The spec's metrics on the wire: the /metrics WSGI app (app), the text and OpenMetrics encoding (encode),
metric families built from spec entries (families) and the pack's own health series (selfmetrics).

May import: core/ and spec/. The sidecar, the trainer and the relay serve through it.
"""

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    # verl_exporter.exposition was the encoding module before it became this package
    encode = importlib.import_module(f"{__name__}.encode")
    if hasattr(encode, name):
        warnings.warn(f"{__name__}.{name} moved to {__name__}.encode.{name}", DeprecationWarning, stacklevel=2)
        return getattr(encode, name)
    raise AttributeError(name)
