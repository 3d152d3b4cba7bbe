"""verl-exporter: Prometheus metrics, alerts and dashboards for verl RL post-training runs."""

__version__ = "0.1.0"

__all__ = ["Monitor", "__version__"]


def __getattr__(name):
    # Lazy, so that importing the package (e.g. for the CLI) starts nothing and imports no server code.
    if name == "Monitor":
        from .trainer.monitor import Monitor

        return Monitor
    raise AttributeError(name)
