"""What every role shares: the HTTP server base, /metrics exposition and the pack's self-metrics, atomic
writes, the shutdown helper, the bearer-token check and the step-domain detectors.

May import: spec/ only. Everything else may import core/.
"""
