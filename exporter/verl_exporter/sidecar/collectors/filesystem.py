"""Size and free space of the filesystems holding the checkpoint directory and each --watch-path (os.statvfs).

The label ``path`` is the path as configured, not the mount point, so that an alert names what fills up.
A path that does not exist yet (a checkpoint directory before the first save) has no series and is not an
error; any other failure (permission denied, a file where a directory should be, a stale NFS handle) is
counted as a problem of this collector and loses only that path's series.

statvfs on a dead hard-mounted NFS server blocks in the kernel and cannot be interrupted. That is accepted
here: the sampler runs each collector on its own thread, so only this collector stalls (its paths after the
hung one included); scrapes keep serving its last samples, and the growing age of
verl_exporter_collector_last_success_timestamp_seconds{collector="filesystem"} shows the hang.
"""

from __future__ import annotations

import os

from .base import Collector, Context, Sample, register


@register
class FilesystemCollector(Collector):
    name = "filesystem"
    description = "size and available bytes of the filesystems holding the checkpoint dir and watched paths"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        paths = ([ctx.config.checkpoint_dir] if ctx.config.checkpoint_dir else []) + list(ctx.config.watch_paths)
        self.paths = list(dict.fromkeys(paths))  # the same path given twice is one series

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        for path in self.paths:
            try:
                st = os.statvfs(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                self.ctx.self_metrics.problem(self.name, "statvfs", f"{path}: {e!r}")
                continue
            labels = {"path": path}
            out.append(("verl_host_filesystem_size_bytes", labels, st.f_blocks * st.f_frsize))
            # f_bavail, not f_bfree: the blocks reserved for root are not available to the trainer.
            out.append(("verl_host_filesystem_avail_bytes", labels, st.f_bavail * st.f_frsize))
        return out
