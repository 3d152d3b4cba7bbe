"""verl-exporter: Prometheus metrics, alerts and dashboards for verl RL post-training runs."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

__all__ = ["Monitor", "__version__"]

# Modules that moved into role folders: the old paths keep working (verl configs name
# verl_exporter.verl_callback.ControlledCheckpointCallback), each with a DeprecationWarning naming the new one;
# the old verl_exporter.sidecar module is the sidecar/ package now (its Sidecar: verl_exporter.sidecar.sidecar).
MOVED = {
    "verl_callback": "trainer.verl_callback", "breaker": "trainer.breaker", "torch_helpers": "trainer.torch_helpers",
    "atomicfile": "core.atomicfile", "auth": "core.auth", "detect": "core.detect",
    "families": "exposition.families", "httpserver": "core.httpserver", "selfmetrics": "exposition.selfmetrics",
    "server": "exposition.app", "shutdown": "core.shutdown", "config": "sidecar.config", "control": "sidecar.control",
    "file_sd": "sidecar.file_sd", "mapper": "sidecar.mapper", "node": "sidecar.node",
    "store": "sidecar.store", "collectors": "sidecar.collectors", "sources": "sidecar.sources",
    "checkpoint_cli": "checkpoint.cli", "checkpoint_manifest": "checkpoint.manifest", "backtest": "tools.backtest",
    "calibrate": "tools.calibrate", "demo": "tools.demo", "demo_stack": "tools.demo_stack", "replay": "tools.replay",
    "core.server": "exposition.app", "core.exposition": "exposition.encode",
    "core.families": "exposition.families", "core.selfmetrics": "exposition.selfmetrics",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """verl_exporter.<old> is the module at its new place (the same object, so isinstance and patches agree)."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(__name__ + ".")
        if fullname.startswith(__name__ + ".") and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = f"{__name__}.{MOVED[spec.name.removeprefix(__name__ + '.')]}"
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module at its new place is already executed


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name):
    # Lazy, so that importing the package (e.g. for the CLI) starts nothing and imports no server code.
    if name == "Monitor":
        from .trainer.monitor import Monitor

        return Monitor
    raise AttributeError(name)
