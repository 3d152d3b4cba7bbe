"""Per-GPU health through NVML: utilisation, memory, power, temperature, clocks and their throttle reasons,
ECC, remapped rows, PCIe replays; energy and (opt-in) PCIe throughput on the slow cadence.

Only cheap NVML reads (about 1 to 10 us each on an H200) run every interval. A field NVML answers with
NotSupported is remembered, never asked again, and shows as verl_gpu_field_supported{field} 0. A GPU that
stops answering shows verl_gpu_up 0 (plus its verl_gpu_info identity) and nothing else until it answers again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Collector, Context, Sample, register
from .nvml import LOST, UNSUPPORTED, Gpu, GpuLost, NvmlSession

# (reason label, suffix of nvmlClocksEventReason<X> / nvmlClocksThrottleReason<X>, bit if the binding lacks it)
CLOCK_EVENT_REASONS = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("applications_clocks_setting", "ApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sync_boost", "SyncBoost", 0x10),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown", 0x80),
    ("display_clock_setting", "DisplayClockSetting", 0x100),
)

# Names of the verl_gpu_field_supported{field} series, one per NVML read (or pair of reads).
FAST_FIELDS = ("utilization", "memory", "memory_reserved", "power", "power_limit", "temperature", "clock_sm",
               "clock_memory", "clock_events", "ecc_volatile", "ecc_aggregate", "remapped_rows", "pcie_replays")
SLOW_FIELDS = ("energy",)
PCIE_FIELD = "pcie_throughput"

KB = 1024  # NVML's PCIe throughput is in KB/s, NVML's KB being 1024 bytes


class _GpuState:
    """What the collector keeps per GPU: fields NVML refused, label dicts built once, the last slow reads."""

    def __init__(self, gpu: Gpu, fields: tuple[str, ...]):
        self.gpu = gpu
        self.unsupported: set[str] = set()
        self.fields = fields
        g = gpu.label
        self.labels = {"gpu": g}
        self.info = {"gpu": g, "uuid": gpu.uuid, "pci_bus_id": gpu.pci_bus_id, "model": gpu.model}
        self.clock_sm = {"gpu": g, "clock": "sm"}
        self.clock_memory = {"gpu": g, "clock": "memory"}
        self.reasons = [({"gpu": g, "reason": name}, name) for name, _, _ in CLOCK_EVENT_REASONS]
        self.ecc = {(error, counter): {"gpu": g, "error": error, "counter": counter}
                    for error in ("corrected", "uncorrected") for counter in ("volatile", "aggregate")}
        self.remap = {cause: {"gpu": g, "cause": cause} for cause in ("correctable", "uncorrectable")}
        self.pcie = {d: {"gpu": g, "direction": d} for d in ("tx", "rx")}
        self.field_labels = {f: {"gpu": g, "field": f} for f in fields}
        self.slow: list[Sample] = []


@register
class GpuCollector(Collector):
    name = "gpu"
    description = "per-GPU utilisation, memory, power, temperature, clocks, throttling, ECC and row remapping (NVML)"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.session = NvmlSession(ctx)
        n = self.nvml = self.session.nvml
        fields = FAST_FIELDS + SLOW_FIELDS + ((PCIE_FIELD,) if ctx.config.gpu_pcie_throughput else ())
        self._states = [_GpuState(g, fields) for g in self.session.gpus]
        self._mem_v2 = getattr(n, "nvmlMemory_v2", None)
        self._reasons_fn: Callable[[Any], int] | None = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._throttle_fn: Callable[[Any], int] | None = getattr(n, "nvmlDeviceGetCurrentClocksThrottleReasons",
                                                                 None)
        if self._reasons_fn is None:  # a binding older than the "event reasons" rename
            self._reasons_fn, self._throttle_fn = self._throttle_fn, None
        self._reason_bits = [
            getattr(n, f"nvmlClocksEventReason{suffix}", getattr(n, f"nvmlClocksThrottleReason{suffix}", bit))
            for _, suffix, bit in CLOCK_EVENT_REASONS]
        self._ecc_types = ((n.NVML_MEMORY_ERROR_TYPE_CORRECTED, "corrected"),
                           (n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "uncorrected"))
        self._ecc_counters = ((n.NVML_VOLATILE_ECC, "volatile", "ecc_volatile"),
                              (n.NVML_AGGREGATE_ECC, "aggregate", "ecc_aggregate"))
        self._function_not_found = getattr(n, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)
        for st in self._states:  # what this binding cannot ask at all
            if self._mem_v2 is None:
                st.unsupported.add("memory_reserved")
            if self._reasons_fn is None:
                st.unsupported.add("clock_events")

    # ------------------------------------------------------------------------------------------ reads
    def _call(self, st: _GpuState, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(handle, *args), or None when the field is unsupported (remembered) or failed this once."""
        try:
            return fn(st.gpu.handle, *args)
        except Exception as e:
            self._failed(st, field, e)
            return None

    def _failed(self, st: _GpuState, field: str, err: Exception) -> None:
        kind = self.session.kind(err)
        if kind == UNSUPPORTED:
            st.unsupported.add(field)
        elif kind == LOST:
            raise GpuLost(str(err)) from None
        else:
            self.ctx.self_metrics.problem(self.name, field, f"GPU {st.gpu.label}: {field} read failed: {err!r}")

    def _memory(self, st: _GpuState) -> tuple[Any, bool]:
        """(memory info, whether it is v2 with ``reserved``); v2 when the binding and driver have it."""
        if "memory_reserved" not in st.unsupported:
            try:
                mem = self.nvml.nvmlDeviceGetMemoryInfo(st.gpu.handle, self._mem_v2)
            except TypeError:  # a binding whose nvmlDeviceGetMemoryInfo takes no version
                st.unsupported.add("memory_reserved")
                mem = None
            except Exception as e:
                self._failed(st, "memory_reserved", e)
                mem = None
            if mem is not None or "memory_reserved" not in st.unsupported:
                return mem, True  # a passing failure: no memory series this once
        if "memory" in st.unsupported:
            return None, False
        return self._call(st, "memory", self.nvml.nvmlDeviceGetMemoryInfo), False

    def _clock_reasons(self, st: _GpuState) -> int | None:
        if self._reasons_fn is None:  # not asked: clock_events is then unsupported
            return None
        try:
            return self._reasons_fn(st.gpu.handle)
        except Exception as e:
            # a driver older than the "event reasons" rename lacks the new symbol: use the old one from now on
            if self._throttle_fn is not None and self.session.is_code(e, self._function_not_found):
                self._reasons_fn, self._throttle_fn = self._throttle_fn, None
                mask: int | None = self._call(st, "clock_events", self._reasons_fn)
                return mask
            self._failed(st, "clock_events", e)
            return None

    def _read_fast(self, st: _GpuState) -> list[Sample]:
        n, L, uns, call = self.nvml, st.labels, st.unsupported, self._call
        rows: list[Sample] = []
        if "utilization" not in uns:
            u = call(st, "utilization", n.nvmlDeviceGetUtilizationRates)
            if u is not None:
                rows.append(("verl_gpu_utilization_ratio", L, u.gpu / 100.0))
                rows.append(("verl_gpu_memory_utilization_ratio", L, u.memory / 100.0))
        mem, v2 = self._memory(st)
        if mem is not None:
            rows.append(("verl_gpu_memory_used_bytes", L, float(mem.used)))
            rows.append(("verl_gpu_memory_total_bytes", L, float(mem.total)))
            if v2:
                rows.append(("verl_gpu_memory_reserved_bytes", L, float(mem.reserved)))
        if "power" not in uns:
            v = call(st, "power", n.nvmlDeviceGetPowerUsage)
            if v is not None:
                rows.append(("verl_gpu_power_watts", L, v / 1000.0))
        if "power_limit" not in uns:
            v = call(st, "power_limit", n.nvmlDeviceGetEnforcedPowerLimit)
            if v is not None:
                rows.append(("verl_gpu_power_limit_watts", L, v / 1000.0))
        if "temperature" not in uns:
            v = call(st, "temperature", n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU)
            if v is not None:
                rows.append(("verl_gpu_temperature_celsius", L, float(v)))
        if "clock_sm" not in uns:
            v = call(st, "clock_sm", n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM)
            if v is not None:
                rows.append(("verl_gpu_clock_hertz", st.clock_sm, v * 1e6))
        if "clock_memory" not in uns:
            v = call(st, "clock_memory", n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_MEM)
            if v is not None:
                rows.append(("verl_gpu_clock_hertz", st.clock_memory, v * 1e6))
        if "clock_events" not in uns:
            mask = self._clock_reasons(st)
            if mask is not None:
                for (labels, _), bit in zip(st.reasons, self._reason_bits, strict=True):
                    rows.append(("verl_gpu_clock_event_active", labels, 1.0 if mask & bit else 0.0))
        for counter, counter_name, field in self._ecc_counters:
            if field in uns:
                continue
            for error, error_name in self._ecc_types:
                v = call(st, field, n.nvmlDeviceGetTotalEccErrors, error, counter)
                if v is None:
                    break
                rows.append(("verl_gpu_ecc_errors_total", st.ecc[(error_name, counter_name)], float(v)))
        if "remapped_rows" not in uns:
            r = call(st, "remapped_rows", n.nvmlDeviceGetRemappedRows)
            if r is not None:
                correctable, uncorrectable, pending, failure = r[:4]
                rows.append(("verl_gpu_remapped_rows", st.remap["correctable"], float(correctable)))
                rows.append(("verl_gpu_remapped_rows", st.remap["uncorrectable"], float(uncorrectable)))
                rows.append(("verl_gpu_row_remap_pending", L, 1.0 if pending else 0.0))
                rows.append(("verl_gpu_row_remap_failed", L, 1.0 if failure else 0.0))
        if "pcie_replays" not in uns:
            v = call(st, "pcie_replays", n.nvmlDeviceGetPcieReplayCounter)
            if v is not None:
                rows.append(("verl_gpu_pcie_replays_total", L, float(v)))
        return rows

    def _read_slow(self, st: _GpuState) -> list[Sample]:
        n, L, uns = self.nvml, st.labels, st.unsupported
        rows: list[Sample] = []
        if "energy" not in uns:
            v = self._call(st, "energy", n.nvmlDeviceGetTotalEnergyConsumption)
            if v is not None:
                rows.append(("verl_gpu_energy_joules_total", L, v / 1000.0))
        if self.ctx.config.gpu_pcie_throughput and PCIE_FIELD not in uns:
            for direction, counter in (("tx", n.NVML_PCIE_UTIL_TX_BYTES), ("rx", n.NVML_PCIE_UTIL_RX_BYTES)):
                v = self._call(st, PCIE_FIELD, n.nvmlDeviceGetPcieThroughput, counter)
                if v is None:
                    break
                rows.append(("verl_gpu_pcie_throughput_bytes_per_second", st.pcie[direction], float(v) * KB))
        return rows

    # ------------------------------------------------------------------------------------------ per GPU
    def _down(self, st: _GpuState, why: str) -> list[Sample]:
        if st.gpu.up:
            self.ctx.self_metrics.problem(self.name, "gpu_lost", f"GPU {st.gpu.label} ({st.gpu.uuid}) is down: {why}")
        st.gpu.up = False
        st.slow = []
        return [("verl_gpu_info", st.info, 1.0), ("verl_gpu_up", st.labels, 0.0)]

    def _sample_gpu(self, st: _GpuState) -> list[Sample]:
        if not st.gpu.up and not self.session.reacquire(st.gpu):
            return self._down(st, "no handle")
        try:
            rows = self._read_fast(st)
        except GpuLost as e:
            return self._down(st, str(e))
        except Exception as e:  # a bug or a binding surprise: this GPU's sample fails, the others go on
            return self._down(st, repr(e))
        st.gpu.up = True
        rows.append(("verl_gpu_info", st.info, 1.0))
        rows.append(("verl_gpu_up", st.labels, 1.0))
        rows.extend(st.slow)
        uns = st.unsupported
        rows.extend(("verl_gpu_field_supported", st.field_labels[f], 0.0 if f in uns else 1.0) for f in st.fields)
        return rows

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        for st in self._states:
            out.extend(self._sample_gpu(st))
        return out

    def sample_slow(self) -> list[Sample]:
        # The reads land in each GPU's state and are served by sample(), so a lost GPU's series go at once.
        for st in self._states:
            if not st.gpu.up:
                continue
            try:
                st.slow = self._read_slow(st)
            except GpuLost as e:
                self._down(st, str(e))
            except Exception as e:
                self.ctx.self_metrics.problem(self.name, "slow", f"GPU {st.gpu.label}: slow read failed: {e!r}")
        return []

    def close(self) -> None:
        self.session.close()
