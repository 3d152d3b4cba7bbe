"""Checkpoint manifests (`verl-exporter checkpoint`): what a complete checkpoint holds, written atomically
beside it, and read back by the checkpoint collector and the control loop.

May import: core/.
"""
