"""What every role stands on: the HTTP server, atomic writes, the shutdown helper, the bearer-token check, the
typed-file base (models), the step-domain detectors (detect) and the cross-rank verdict.

May import: nothing of the package. Everything else may import core/.
"""
