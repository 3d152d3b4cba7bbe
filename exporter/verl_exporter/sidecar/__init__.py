"""The per-rank sidecar (`verl-exporter serve`): follows verl's file log (sources/), samples GPUs, host, disk
and checkpoints (collectors/, one per file), keeps the latest values (store, mapper) and serves /metrics,
/control and file_sd.

May import: core/, spec/, checkpoint/. Never render/ (the generator) or tools/.
"""
