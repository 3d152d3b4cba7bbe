"""NVLink per GPU: whether it exists, link states, DL error counters per link, data bytes in and out.

Whether a GPU has NVLink is asked once (link 0's state; NotSupported = none, as on single-GPU machines), and
so is its link count (links answer up to the first that says NotSupported or InvalidArgument). The data
counters come from one nvmlDeviceGetFieldValues batch per GPU (about 400 us on an H200), for all links at
once (scopeId UINT_MAX) or, where the driver refuses that, summed over per-link scopes.
"""

from __future__ import annotations

from typing import Any

from .base import Collector, Context, Sample, register
from .nvml import LOST, UINT_MAX, UNSUPPORTED, Gpu, GpuLost, NvmlSession

# (type label, pynvml constant, its value if the binding lacks it)
ERROR_COUNTERS = (
    ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2),
    ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA", 3),
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY", 0),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY", 1),
)
KIB = 1024

ALL_LINKS = "all_links"  # one scopeId UINT_MAX entry per direction
PER_LINK = "per_link"  # one entry per link and direction, summed


class _LinkState:
    def __init__(self, gpu: Gpu):
        self.gpu = gpu
        self.supported: bool | None = None  # None until asked
        self.links: list[int] = []
        self.error_plan: list[tuple[int, int, str]] = []  # (link, counter, error type) still asked
        self.throughput: str | None = ALL_LINKS  # None once the driver refuses both ways
        g = gpu.label
        self.labels = {"gpu": g}
        self.link_labels: dict[int, dict[str, str]] = {}
        self.direction_labels = {d: {"gpu": g, "direction": d} for d in ("tx", "rx")}


@register
class NvlinkCollector(Collector):
    name = "nvlink"
    description = "NVLink link states, per-link error counters and data bytes per GPU (NVML)"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.session = NvmlSession(ctx)
        n = self.nvml = self.session.nvml
        self._max_links = int(getattr(n, "NVML_NVLINK_MAX_LINKS", 18))
        self._counters = [(name, getattr(n, const, default)) for name, const, default in ERROR_COUNTERS]
        self._tx = getattr(n, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138)
        self._rx = getattr(n, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139)
        self._success = getattr(n, "NVML_SUCCESS", 0)
        self._refusals = {getattr(n, "NVML_ERROR_NOT_SUPPORTED", 3), self.session.invalid_argument_code}
        self._states = [_LinkState(g) for g in self.session.gpus]

    def _refused(self, err: Exception) -> bool:
        """NotSupported or InvalidArgument: this link (or the GPU's NVLink) does not exist."""
        return self.session.kind(err) == UNSUPPORTED or self.session.is_code(err, self.session.invalid_argument_code)

    def _fail(self, st: _LinkState, what: str, err: Exception) -> None:
        if self.session.kind(err) == LOST:
            raise GpuLost(str(err)) from None
        self.ctx.self_metrics.problem(self.name, what, f"GPU {st.gpu.label}: NVLink {what} failed: {err!r}")

    def _discover(self, st: _LinkState) -> None:
        """Asked once per GPU: NVLink or not, and how many links answer."""
        state = self.nvml.nvmlDeviceGetNvLinkState
        links = []
        for link in range(self._max_links):
            try:
                state(st.gpu.handle, link)
            except Exception as e:
                if self._refused(e):
                    break
                self._fail(st, "discovery", e)
                return  # a passing failure: ask again next sample
            links.append(link)
        st.supported = bool(links)
        st.links = links
        g = st.gpu.label
        st.link_labels = {link: {"gpu": g, "link": str(link)} for link in links}
        st.error_plan = [(link, code, t) for link in links for t, code in self._counters]

    def _field_value(self, fv: Any) -> float:
        kind = getattr(fv, "valueType", 3)
        attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(kind, "ullVal")
        return float(getattr(fv.value, attr))

    def _throughput(self, st: _LinkState) -> list[Sample]:
        h = st.gpu.handle
        rows: list[Sample] = []
        for _ in range(2):  # at most once more, after falling back from all-links to per-link scopes
            if st.throughput is None:
                return rows
            if st.throughput == ALL_LINKS:
                ids = [(self._tx, UINT_MAX), (self._rx, UINT_MAX)]
            else:
                ids = [(fid, link) for link in st.links for fid in (self._tx, self._rx)]
            try:
                values = self.nvml.nvmlDeviceGetFieldValues(h, ids)
            except Exception as e:
                if self._refused(e):
                    st.throughput = PER_LINK if st.throughput == ALL_LINKS else None
                    continue
                self._fail(st, "field_values", e)
                return rows
            totals = {self._tx: 0.0, self._rx: 0.0}
            answered = {self._tx: 0, self._rx: 0}
            refused = 0
            for fv in values:
                if fv.nvmlReturn == self._success:
                    totals[fv.fieldId] += self._field_value(fv)
                    answered[fv.fieldId] += 1
                elif fv.nvmlReturn in self._refusals:
                    refused += 1
            if st.throughput == ALL_LINKS and refused:
                st.throughput = PER_LINK
                continue
            if not any(answered.values()):
                if refused == len(ids):
                    st.throughput = None  # no link reports its data counters
                return rows
            for direction, fid in (("tx", self._tx), ("rx", self._rx)):
                if answered[fid]:
                    rows.append(("verl_gpu_nvlink_data_bytes_total", st.direction_labels[direction],
                                 totals[fid] * KIB))
            return rows
        return rows

    def _sample_gpu(self, st: _LinkState) -> list[Sample]:
        if st.supported is None:
            self._discover(st)
            if st.supported is None:
                return []
        if not st.supported:
            return [("verl_gpu_nvlink_supported", st.labels, 0.0)]
        n, h = self.nvml, st.gpu.handle
        rows: list[Sample] = [("verl_gpu_nvlink_supported", st.labels, 1.0)]
        state, counter = n.nvmlDeviceGetNvLinkState, n.nvmlDeviceGetNvLinkErrorCounter
        down, read = 0, 0
        for link, labels in st.link_labels.items():
            try:
                up = state(h, link) == 1
            except Exception as e:
                self._fail(st, "state", e)
                continue
            rows.append(("verl_gpu_nvlink_link_up", labels, 1.0 if up else 0.0))
            down, read = down + (not up), read + 1
        if read:  # one series per GPU for the alert: a fleet's per-link series are 18x as many to evaluate
            rows.append(("verl_gpu_nvlink_links_down", st.labels, float(down)))
        # Error counters are summed over the links, per type: 4 series per GPU instead of 4 per link (72 on an
        # H200), which is what the scale run showed dominating series and rule time; a link that goes down is
        # still seen per link in link_up.
        refused: list[tuple[int, int]] = []
        totals: dict[str, float] = {}
        broken: set[str] = set()
        for link, code, kind in st.error_plan:
            try:
                totals[kind] = totals.get(kind, 0.0) + float(counter(h, link, code))
            except Exception as e:
                if not self._refused(e):
                    self._fail(st, "error_counter", e)
                    broken.add(kind)  # a partial sum would look like a counter reset: skip this type now
                    continue
                refused.append((link, code))
        for kind, total in totals.items():
            if kind not in broken:
                rows.append(("verl_gpu_nvlink_errors_total", {"gpu": st.gpu.label, "type": kind}, total))
        if refused:  # never asked again
            st.error_plan = [p for p in st.error_plan if (p[0], p[1]) not in refused]
        rows.extend(self._throughput(st))
        return rows

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        for st in self._states:
            gpu = st.gpu
            if not gpu.up and not self.session.reacquire(gpu):
                continue  # the gpu collector shows verl_gpu_up 0; no NVLink series meanwhile
            try:
                rows = self._sample_gpu(st)
            except GpuLost:
                gpu.up = False
                continue
            except Exception as e:
                self.ctx.self_metrics.problem(self.name, "sample", f"GPU {gpu.label}: NVLink sample failed: {e!r}")
                continue
            gpu.up = True
            out.extend(rows)
        return out

    def close(self) -> None:
        self.session.close()
