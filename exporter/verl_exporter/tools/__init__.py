"""Offline tools, never in a training or serving path: the replay engine and simulator, backtest, calibrate
and the two demos.

May import anything in the package.
"""
