"""The rollout engines' metric definitions, read from their packages' source (vLLM, SGLang).

``extract`` finds each named metric's constructor call in a package source file and keeps its exact lines, so
that tests/data/engine_metrics.json records what the package declares and spec/test_spec_engine_metrics.py checks the
spec's engine alerts against it; the integration test re-derives the file from the real wheels.
"""

from __future__ import annotations

import ast

# package -> (version, source file, metric names whose definitions the pack relies on)
PINNED = {
    "vllm": ("0.33.0", "vllm/v1/metrics/loggers.py", (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds")),
    "sglang": ("0.5.23", "sglang/srt/observability/metrics_collector.py", (
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
        "sglang:cache_hit_rate", "sglang:num_retracted_requests_total", "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
        "sglang:request_time_per_output_token_seconds", "sglang:e2e_request_latency_seconds")),
}
# vLLM's default buckets live in their own module; SGLang's are literals in the collector
# (`if bucket_x is None: bucket_x = [...]`).
VLLM_BUCKETS = "vllm/v1/metrics/buckets.py"
TYPES = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram"}


def _type(call: ast.Call) -> str:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    # vLLM calls self._gauge_cls / self._counter_cls / self._histogram_cls
    return TYPES.get(name) or name.strip("_").removesuffix("_cls")


def extract(source: str, names: tuple[str, ...]) -> dict[str, dict]:
    """Each named metric's type, exposed name and constructor source lines."""
    lines = source.splitlines()
    found: dict[str, dict] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        name = kw.get("name")
        if isinstance(name, ast.Constant) and name.value in names:
            mtype = _type(node)
            # prometheus_client exposes a counter with _total appended unless the name has it already
            exposed = name.value if mtype != "counter" or name.value.endswith("_total") else name.value + "_total"
            found[name.value] = {"type": mtype, "exposed": exposed,
                                 "lines": lines[node.lineno - 1:node.end_lineno], "line": node.lineno}
    return found


def bucket_constants(source: str) -> dict[str, list[float]]:
    """Module-level tuple constants named *_BUCKETS (vLLM's default bucket families)."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id.endswith("_BUCKETS") and node.value is not None:
                out[target.id] = list(ast.literal_eval(node.value))
    return out


def default_buckets(source: str) -> dict[str, list[float]]:
    """SGLang's default bucket lists: each literal list assigned to a name bucket_* (its histograms' buckets=)."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id.startswith("bucket_"):
                out[target.id] = [float(x) for x in ast.literal_eval(node.value)]
    return out


def derive(read) -> dict:
    """The extract for every pinned package; ``read(package, path)`` returns a source file's text."""
    out = {}
    for pkg, (version, path, names) in PINNED.items():
        entry = {"version": version, "path": path, "metrics": extract(read(pkg, path), names)}
        if pkg == "vllm":  # its label names are one list, its default buckets a module of their own
            entry["labelnames_source"] = [line for line in read(pkg, path).splitlines()
                                          if line.strip().startswith("labelnames = [")]
            entry["buckets"] = {"path": VLLM_BUCKETS, "families": bucket_constants(read(pkg, VLLM_BUCKETS))}
        else:
            entry["buckets"] = {"path": path, "families": default_buckets(read(pkg, path))}
        out[pkg] = entry
    return out
