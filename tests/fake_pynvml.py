"""A fake ``pynvml`` (nvidia-ml-py) for tests and benchmarks: pass ``lambda: fake`` as Context.nvml_loader.

It mirrors the names, signatures, constants and error classes of nvidia-ml-py 13.x that the GPU collectors
use, holds per-device values the test sets, and can make any call fail for any device. Every call is
counted in ``fake.calls[(function name, NVML index)]`` (index None for calls without a device), so tests can
prove that a field NVML refused is not asked again.

    fake = FakeNvml(gpus=2)
    fake.gpu(0).power_mw = 250_000
    fake.fail("nvmlDeviceGetPowerUsage", NVML_ERROR_NOT_SUPPORTED, gpu=1)
    fake.lose(0)        # every call on GPU 0 raises GPU_IS_LOST; its old handles stay dead for good
    fake.restore(0)     # answers again, but only through a handle acquired anew (by UUID)
    fake.inject_xid(1, 79)

A handle's identity is not stable (each lookup returns a new object), like ctypes pointers: code must compare
devices by UUID. ``costs_us`` makes calls take time (the H200 probe's medians in PROBE_COSTS_US), busy-waiting
below 1 ms (as NVML's ioctls cost CPU) and sleeping above (the PCIe counter samples a 20 ms window).
"""

from __future__ import annotations

import collections
import os
import string
import threading
import time
from dataclasses import dataclass, field

# ------------------------------------------------------------------------------------------- constants
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_CLOCK_VIDEO = 3
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_NVLINK_ERROR_DL_CRC_DATA = 3
NVML_NVLINK_ERROR_DL_ECC_DATA = 4
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1

NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
NVML_VALUE_TYPE_SIGNED_INT = 5
NVML_VALUE_TYPE_UNSIGNED_SHORT = 6

NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = 45
NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 52
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 59
NVML_FI_DEV_NVLINK_LINK_COUNT = 91
NVML_FI_DEV_PCIE_REPLAY_COUNTER = 94
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX = 140
NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX = 141

nvmlMemory_v2 = 0x02000028

nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypePState = 0x0000000000000004
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeClock = 0x0000000000000010
nvmlEventTypeNone = 0x0000000000000000

_REASONS = {"GpuIdle": 0x1, "ApplicationsClocksSetting": 0x2, "SwPowerCap": 0x4, "HwSlowdown": 0x8,
            "SyncBoost": 0x10, "SwThermalSlowdown": 0x20, "HwThermalSlowdown": 0x40,
            "HwPowerBrakeSlowdown": 0x80, "DisplayClockSetting": 0x100}
for _name, _bit in _REASONS.items():
    globals()[f"nvmlClocksEventReason{_name}"] = _bit
    globals()[f"nvmlClocksThrottleReason{_name}"] = _bit
nvmlClocksEventReasonNone = nvmlClocksThrottleReasonNone = 0

UINT_MAX = 0xFFFFFFFF

# Medians measured on one H200 (driver 580, nvidia-ml-py 13.610), microseconds per call.
PROBE_COSTS_US = {
    "nvmlDeviceGetUtilizationRates": 3.7, "nvmlDeviceGetMemoryInfo": 5.8, "nvmlDeviceGetPowerUsage": 1.0,
    "nvmlDeviceGetEnforcedPowerLimit": 1.0, "nvmlDeviceGetTemperature": 1.1, "nvmlDeviceGetClockInfo": 1.1,
    "nvmlDeviceGetCurrentClocksEventReasons": 1.0, "nvmlDeviceGetTotalEccErrors": 1.6,
    "nvmlDeviceGetRemappedRows": 1.6, "nvmlDeviceGetPcieReplayCounter": 1.5,
    "nvmlDeviceGetComputeRunningProcesses": 8.0, "nvmlDeviceGetFieldValues": 398.0,
    "nvmlDeviceGetTotalEnergyConsumption": 2970.0, "nvmlDeviceGetPcieThroughput": 20828.0,
    "nvmlDeviceGetNvLinkState": 1.0, "nvmlDeviceGetNvLinkErrorCounter": 1.5,
}

_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout", NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart", NVML_ERROR_UNKNOWN: "Unknown Error",
}


# ------------------------------------------------------------------------------------------- errors
class NVMLError(Exception):
    """Same shape as nvidia-ml-py's: NVMLError(code) builds the NVMLError_<Name> subclass, ``.value`` = code."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value=None, *args):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self):
        return _ERROR_STRINGS.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other):
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


class NVMLLibraryMismatchError(Exception):
    pass


def _make_error_classes() -> None:
    for name, value in list(globals().items()):
        if not name.startswith("NVML_ERROR_"):
            continue
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def new(cls, *args, _value=value):
            return NVMLError.__new__(cls, _value)

        cls = type(class_name, (NVMLError,), {"__new__": new})
        globals()[class_name] = cls
        NVMLError._valClassMapping[value] = cls


_make_error_classes()


# ------------------------------------------------------------------------------------------- values
class _Obj:
    """A plain attribute bag, like pynvml's friendly objects and ctypes structs."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __repr__(self):
        return f"_Obj({self.__dict__})"


@dataclass
class FakeGpu:
    """One device; change its fields between samples."""

    uuid: str
    pci_bus_id: str
    name: str = "NVIDIA H200"
    util_gpu: int = 0  # percent
    util_mem: int = 0
    mem_total: int = 150754820096
    mem_used: int = 644939776
    mem_reserved: int = 566493184
    mem_v2: bool = True  # False: nvmlDeviceGetMemoryInfo_v2 is missing (older driver)
    power_mw: int = 101863
    power_limit_mw: int = 700000
    temperature: int = 33
    clocks_mhz: dict = field(default_factory=lambda: {NVML_CLOCK_SM: 885, NVML_CLOCK_MEM: 3201})
    clock_reasons: int = 0x1
    ecc: dict = field(default_factory=dict)  # (error type, counter type) -> count; missing = 0
    remapped_rows: tuple = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    pcie_replay: int = 0
    energy_mj: int = 2457098
    pcie_kbs: dict = field(default_factory=lambda: {NVML_PCIE_UTIL_TX_BYTES: 696, NVML_PCIE_UTIL_RX_BYTES: 1200})
    nvlink_states: list = field(default_factory=list)  # per link: 1 active, 0 down; empty = no NVLink
    nvlink_errors: dict = field(default_factory=dict)  # (link, NVML_NVLINK_ERROR_DL_*) -> count
    nvlink_tx_kib: list = field(default_factory=list)  # per link, cumulative KiB
    nvlink_rx_kib: list = field(default_factory=list)
    processes: list = field(default_factory=list)  # (pid, usedGpuMemory or None)
    mig_uuids: list = field(default_factory=list)  # MIG devices of this GPU
    xid_supported: bool = True
    lost: bool = False
    generation: int = 0  # bumped by restore(): handles taken before stay dead

    def set_nvlink(self, links: int, tx_kib: int = 0, rx_kib: int = 0) -> None:
        self.nvlink_states = [1] * links
        self.nvlink_tx_kib = [tx_kib] * links
        self.nvlink_rx_kib = [rx_kib] * links


class FakeHandle:
    __slots__ = ("index", "generation", "mig_uuid")

    def __init__(self, index: int, generation: int, mig_uuid: str | None = None):
        self.index, self.generation, self.mig_uuid = index, generation, mig_uuid

    def __repr__(self):
        return f"FakeHandle({self.index}, gen {self.generation}{', ' + self.mig_uuid if self.mig_uuid else ''})"


class FakeEventSet:
    def __init__(self):
        self.devices: set[int] = set()
        self.types: dict[int, int] = {}
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.freed = False


def default_uuid(i: int) -> str:
    return f"GPU-{i:08x}-1e9b-25af-fbde-b4e7a3e7d4e0"


def default_pci(i: int) -> str:
    return f"00000000:{0x18 + 0x10 * i:02X}:00.0"


# ------------------------------------------------------------------------------------------- the module
class FakeNvml:
    """Module-like: constants and error classes as attributes, nvml* functions as methods."""

    def __init__(self, gpus: int | list[FakeGpu] = 1, nvlink_links: int = 0, costs_us: dict | None = None):
        if isinstance(gpus, int):
            gpus = [FakeGpu(uuid=default_uuid(i), pci_bus_id=default_pci(i)) for i in range(gpus)]
        self.gpus: list[FakeGpu] = gpus
        for g in self.gpus:
            if nvlink_links and not g.nvlink_states:
                g.set_nvlink(nvlink_links)
        self.calls: collections.Counter = collections.Counter()
        self.failures: dict[tuple[str, int | None], int] = {}
        self.init_error: int | None = None  # code nvmlInit raises (LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED...)
        self.init_calls = 0
        self.shutdown_calls = 0
        self.refcount = 0
        self.nvlink_scope_all = True  # False: field values refuse scopeId UINT_MAX (per-link sums needed)
        self.costs_us: dict[str, float] = dict(costs_us or {})
        self.event_sets: list[FakeEventSet] = []
        self._lock = threading.Lock()

    # ---- test controls
    def gpu(self, i: int) -> FakeGpu:
        return self.gpus[i]

    def fail(self, func: str, code: int, gpu: int | None = None) -> None:
        """Make ``func`` raise NVMLError(code), for one device (gpu=index) or all (gpu=None)."""
        self.failures[(func, gpu)] = code

    def clear_failures(self) -> None:
        self.failures.clear()

    def lose(self, i: int) -> None:
        self.gpus[i].lost = True

    def restore(self, i: int) -> None:
        self.gpus[i].lost = False
        self.gpus[i].generation += 1

    def count(self, func: str, gpu: int | None = None) -> int:
        """Calls of func, for one device or (gpu=None) all together."""
        if gpu is not None:
            return self.calls[(func, gpu)]
        return sum(n for (f, _), n in self.calls.items() if f == func)

    def inject_xid(self, i: int, xid: int, event_type: int = nvmlEventTypeXidCriticalError) -> None:
        """Deliver an event to every event set that registered GPU i for this type."""
        for s in self.event_sets:
            if i in s.devices and s.types.get(i, 0) & event_type and not s.freed:
                with s.cond:
                    s.queue.append(_Obj(device=FakeHandle(i, self.gpus[i].generation), eventType=event_type,
                                        eventData=xid, gpuInstanceId=UINT_MAX, computeInstanceId=UINT_MAX))
                    s.cond.notify_all()

    # ---- plumbing
    def _spend(self, func: str) -> None:
        cost = self.costs_us.get(func)
        if cost:
            if cost >= 1000:
                time.sleep(cost / 1e6)
            else:
                end = time.perf_counter() + cost / 1e6
                while time.perf_counter() < end:
                    pass

    def _check(self, func: str, index: int | None) -> None:
        self.calls[(func, index)] += 1
        if self.refcount <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        code = self.failures.get((func, index), self.failures.get((func, None)))
        if code is not None:
            raise NVMLError(code)
        self._spend(func)

    def _dev(self, func: str, handle) -> FakeGpu:
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self.gpus):
            self.calls[(func, None)] += 1
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        self._check(func, handle.index)
        g = self.gpus[handle.index]
        if g.lost or handle.generation != g.generation:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return g

    def __getattr__(self, name):
        # constants and error classes of this module, like attributes of pynvml
        value = globals().get(name)
        if value is None or not (name.startswith(("NVML", "nvml")) or name == "UINT_MAX"):
            raise AttributeError(name)
        return value

    # ---- init
    def nvmlInit(self):
        self.calls[("nvmlInit", None)] += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.init_calls += 1
        self.refcount += 1

    def nvmlInitWithFlags(self, flags):
        self.nvmlInit()

    def nvmlShutdown(self):
        self.calls[("nvmlShutdown", None)] += 1
        if self.refcount <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        self.shutdown_calls += 1
        self.refcount -= 1

    def nvmlSystemGetDriverVersion(self):
        self._check("nvmlSystemGetDriverVersion", None)
        return "580.159.04"

    # ---- devices
    def nvmlDeviceGetCount(self):
        self._check("nvmlDeviceGetCount", None)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return FakeHandle(index, self.gpus[index].generation)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, g in enumerate(self.gpus):
            if uuid in g.mig_uuids:
                self._check("nvmlDeviceGetHandleByUUID", i)
                return FakeHandle(i, g.generation, mig_uuid=uuid)
            if g.uuid == uuid:
                self._check("nvmlDeviceGetHandleByUUID", i)
                if g.lost:
                    raise NVMLError(NVML_ERROR_GPU_IS_LOST)
                return FakeHandle(i, g.generation)
        self._check("nvmlDeviceGetHandleByUUID", None)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice):  # noqa: N803 - pynvml's name
        g = self._dev("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
        if migDevice.mig_uuid is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(migDevice.index, g.generation)

    def nvmlDeviceIsMigDeviceHandle(self, device):
        return int(device.mig_uuid is not None)

    def nvmlDeviceGetUUID(self, handle):
        g = self._dev("nvmlDeviceGetUUID", handle)
        return handle.mig_uuid or g.uuid

    def nvmlDeviceGetName(self, handle):
        return self._dev("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetIndex(self, handle):
        self._dev("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetPciInfo(self, handle):
        g = self._dev("nvmlDeviceGetPciInfo", handle)
        domain, bus, rest = g.pci_bus_id.split(":")
        dev = rest.split(".")[0]
        return _Obj(busId=g.pci_bus_id, busIdLegacy=g.pci_bus_id[4:], domain=int(domain, 16), bus=int(bus, 16),
                    device=int(dev, 16), pciDeviceId=0x233510DE, pciSubSystemId=0x18081BD)

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetUtilizationRates(self, handle):
        g = self._dev("nvmlDeviceGetUtilizationRates", handle)
        return _Obj(gpu=g.util_gpu, memory=g.util_mem)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        g = self._dev("nvmlDeviceGetMemoryInfo", handle)
        free = g.mem_total - g.mem_used - g.mem_reserved
        if not version:
            # v1's "used" includes what the driver reserves
            return _Obj(total=g.mem_total, free=free, used=g.mem_used + g.mem_reserved)
        if not g.mem_v2:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        if version != nvmlMemory_v2:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return _Obj(version=version, total=g.mem_total, reserved=g.mem_reserved, free=free, used=g.mem_used)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._dev("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._dev("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        return self._dev("nvmlDeviceGetPowerManagementLimit", handle).power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._dev("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetTemperature(self, handle, sensor):
        g = self._dev("nvmlDeviceGetTemperature", handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return g.temperature

    def nvmlDeviceGetClockInfo(self, handle, type):  # noqa: A002 - pynvml's parameter name
        g = self._dev("nvmlDeviceGetClockInfo", handle)
        if type not in g.clocks_mhz:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.clocks_mhz[type]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._dev("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._dev("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):  # noqa: N803 - pynvml's names
        g = self._dev("nvmlDeviceGetTotalEccErrors", handle)
        return g.ecc.get((errorType, counterType), 0)

    def nvmlDeviceGetRemappedRows(self, device):
        return tuple(self._dev("nvmlDeviceGetRemappedRows", device).remapped_rows)

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        return self._dev("nvmlDeviceGetPcieReplayCounter", handle).pcie_replay

    def nvmlDeviceGetPcieThroughput(self, device, counter):
        g = self._dev("nvmlDeviceGetPcieThroughput", device)
        if counter not in g.pcie_kbs:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return g.pcie_kbs[counter]

    # ---- processes
    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        g = self._dev("nvmlDeviceGetComputeRunningProcesses", handle)
        return [_Obj(pid=pid, usedGpuMemory=used, gpuInstanceId=UINT_MAX, computeInstanceId=UINT_MAX)
                for pid, used in g.processes]

    nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses

    # ---- NVLink
    def _link(self, func: str, handle, link: int) -> FakeGpu:
        g = self._dev(func, handle)
        if not g.nvlink_states:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(g.nvlink_states):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return g

    def nvmlDeviceGetNvLinkState(self, device, link):
        return self._link("nvmlDeviceGetNvLinkState", device, link).nvlink_states[link]

    def nvmlDeviceGetNvLinkErrorCounter(self, device, link, counter):
        g = self._link("nvmlDeviceGetNvLinkErrorCounter", device, link)
        return g.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):  # noqa: N803 - pynvml's name
        g = self._dev("nvmlDeviceGetFieldValues", handle)
        out = []
        for item in fieldIds:
            field_id, scope = item if isinstance(item, tuple) else (item, 0)
            ret, value = NVML_ERROR_NOT_SUPPORTED, 0
            if field_id == NVML_FI_DEV_PCIE_REPLAY_COUNTER:
                ret, value = NVML_SUCCESS, g.pcie_replay
            elif field_id in (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX):
                per_link = g.nvlink_tx_kib if field_id == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else g.nvlink_rx_kib
                if not g.nvlink_states:
                    ret = NVML_ERROR_NOT_SUPPORTED
                elif scope == UINT_MAX:
                    ret, value = ((NVML_SUCCESS, sum(per_link)) if self.nvlink_scope_all
                                  else (NVML_ERROR_INVALID_ARGUMENT, 0))
                elif 0 <= scope < len(per_link):
                    ret, value = NVML_SUCCESS, per_link[scope]
                else:
                    ret = NVML_ERROR_INVALID_ARGUMENT
            out.append(_Obj(fieldId=field_id, scopeId=scope, timestamp=int(time.time() * 1e6), latencyUsec=0,
                            valueType=NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlReturn=ret,
                            value=_Obj(ullVal=value, dVal=float(value), uiVal=value, ulVal=value, sllVal=value,
                                       siVal=value, usVal=value)))
        return out

    # ---- events
    def nvmlEventSetCreate(self):
        self._check("nvmlEventSetCreate", None)
        s = FakeEventSet()
        with self._lock:
            self.event_sets.append(s)
        return s

    def nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):  # noqa: N803 - pynvml's names
        g = self._dev("nvmlDeviceRegisterEvents", handle)
        if not g.xid_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        eventSet.devices.add(handle.index)
        eventSet.types[handle.index] = eventSet.types.get(handle.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet, timeoutms):
        self._check("nvmlEventSetWait_v2", None)
        if eventSet.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        with eventSet.cond:
            if not eventSet.queue:
                eventSet.cond.wait(timeoutms / 1000)
            if not eventSet.queue:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            return eventSet.queue.popleft()

    def nvmlEventSetWait(self, eventSet, timeoutms):
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet):
        self._check("nvmlEventSetFree", None)
        with eventSet.cond:
            eventSet.freed = True
            eventSet.cond.notify_all()


# ------------------------------------------------------------------------------------------- test support
def busy_node(gpus: int | list[FakeGpu] = 2, nvlink_links: int = 4, costs_us: dict | None = None) -> FakeNvml:
    """A node under training load: every GPU busy, NVLink traffic on every link, and two processes on each
    GPU, this one (40 GiB) and its parent (1 GiB), so that role lookups hit a real /proc. What the fake-GPU
    sidecar, the golden /metrics and the benchmarks serve."""
    fake = FakeNvml(gpus, nvlink_links=nvlink_links, costs_us=costs_us)
    for i, g in enumerate(fake.gpus):
        g.util_gpu, g.util_mem, g.power_mw = 90 - i % 10, 40, 600_000 + 1000 * i
        g.processes = [(os.getpid(), 40 << 30), (os.getppid(), 1 << 30)]
        g.nvlink_tx_kib = [1 << 20] * nvlink_links
        g.nvlink_rx_kib = [1 << 20] * nvlink_links
    return fake


def make_context(fake: FakeNvml | None, **overrides):
    """A collectors Context on the real spec whose NVML is ``fake`` (None: the real binding)."""
    from verl_exporter.exposition.selfmetrics import SelfMetrics
    from verl_exporter.sidecar.collectors import Context
    from verl_exporter.sidecar.config import ServeConfig

    spec = overrides.pop("spec", None) or _spec()
    values = {"environ": {}, "nvml_loader": (lambda: fake) if fake is not None else None}
    values.update({k: overrides.pop(k) for k in list(overrides) if k in ("environ", "nvml_loader", "clock")})
    settings = ServeConfig(**{"gpus": "all", **overrides})  # the rest are serve settings
    return Context(spec=spec, self_metrics=SelfMetrics(spec), config=settings, **values)


def _spec():
    global _SPEC
    if _SPEC is None:  # parsed once per test process: it takes ~0.1 s
        from verl_exporter.spec import load_spec

        _SPEC = load_spec()
    return _SPEC


_SPEC = None


def rows(samples) -> dict[tuple[str, frozenset], float]:
    """{(metric name, frozenset of label pairs): value} from a collector's samples."""
    return {(name, frozenset(labels.items())): value for name, labels, value in samples}


def value(samples, name: str, **labels) -> float | None:
    """The value of the one sample of ``name`` with exactly these labels, or None when absent."""
    want = frozenset((k, str(v)) for k, v in labels.items())
    return rows(samples).get((name, want))


def series_of(samples, gpu: str | int) -> set[str]:
    """Names of the metrics that have a series for this gpu label."""
    return {name for name, labels, _ in samples if labels.get("gpu") == str(gpu)}
