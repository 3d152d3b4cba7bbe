"""What runs inside the training process: the Monitor API (an in-process sidecar), the circuit breaker, the
torch helpers (imported lazily: torch is optional) and verl's callback, which reads the control file.

May import: sidecar/, core/, spec/, checkpoint/. Never render/ or tools/.
"""
