"""`verl-exporter preflight`: the gate a launcher runs on each node before main_ppo, and a restart policy
before a resume. One module per check group (gpus, fabric, disk, resume, paging); report.py holds what a
check returns, how the results print and the result file the sidecar exports.

Each check returns findings, one line each, a failing one saying what to do. Nothing on disk changes but
the writability probe (created and removed in the checkpoint folder), the result file in --state-dir and this
node's entry in --manifests-dir, both only when asked for.
"""
