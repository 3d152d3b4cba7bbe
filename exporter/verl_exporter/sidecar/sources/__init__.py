"""Where training values come from: verl's file logger (followed) and its console output (converted).

May import: core/ and the sidecar's store.
"""
