"""NVML access shared by the GPU collectors (gpu, nvlink, xid, gpu_processes): load, init, pick this rank's GPUs.

- The binding is ``ctx.nvml_loader()`` when set (tests pass a fake), else ``import pynvml`` (nvidia-ml-py).
  ``nvmlInit`` runs once per process and binding, ``nvmlShutdown`` when the last session closes.
- A missing binding, library or driver raises ``Unavailable`` with one reason; the sidecar then runs without
  the GPU collectors.
- GPUs are held by UUID; the ``gpu`` label is the NVML index (what nvidia-smi shows). After a GPU-lost error
  the handle is looked up again by UUID on every sample, so a GPU that comes back is picked up again.
- ``--gpus auto`` reads CUDA_VISIBLE_DEVICES. Its numbers are CUDA ordinals, which need not follow NVML's
  order: they are read in PCI bus id order, which is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID (what
  launchers commonly set) and also under CUDA's default FASTEST_FIRST on a node of identical GPUs (ties go
  by PCI bus id). On a node of mixed GPUs without PCI_BUS_ID, prefer UUIDs (``GPU-...``) in
  CUDA_VISIBLE_DEVICES or --gpus; a warning says so.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

from .base import Context, Unavailable

log = logging.getLogger(__name__)

UINT_MAX = 0xFFFFFFFF

# Error kinds of a call on one GPU
UNSUPPORTED = "unsupported"  # the field does not exist here: its series are absent, it is not asked again
LOST = "lost"  # the GPU does not answer at all: verl_gpu_up 0 until it does
OTHER = "other"  # a passing failure of one read: counted as a problem, retried next sample

# Standard NVML return codes, used when a binding lacks the constant.
_CODES = {"UNINITIALIZED": 1, "INVALID_ARGUMENT": 2, "NOT_SUPPORTED": 3, "NO_PERMISSION": 4,
          "DRIVER_NOT_LOADED": 9, "TIMEOUT": 10, "LIBRARY_NOT_FOUND": 12, "FUNCTION_NOT_FOUND": 13,
          "GPU_IS_LOST": 15, "RESET_REQUIRED": 16, "LIB_RM_VERSION_MISMATCH": 18,
          "ARGUMENT_VERSION_MISMATCH": 25, "GPU_NOT_FOUND": 28, "UNKNOWN": 999}


class GpuSelectionError(ValueError):
    """--gpus or CUDA_VISIBLE_DEVICES names a GPU that is not here: a configuration mistake, said loudly."""


def code(nvml: Any, name: str) -> int:
    return getattr(nvml, f"NVML_ERROR_{name}", _CODES[name])


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ------------------------------------------------------------------------------------------ init, refcounted
_lock = threading.Lock()
_sessions: dict[int, list[Any]] = {}  # id(binding) -> [binding, open sessions]


def _init_failure(nvml: Any, err: Exception) -> str:
    value = getattr(err, "value", None)
    if value == code(nvml, "LIBRARY_NOT_FOUND"):
        return "the NVML library (libnvidia-ml.so.1) is not found: no NVIDIA driver on this machine or container"
    if value == code(nvml, "DRIVER_NOT_LOADED"):
        return "the NVIDIA driver is not loaded"
    if value == code(nvml, "NO_PERMISSION"):
        return "no permission to open the NVIDIA devices"
    if value == code(nvml, "LIB_RM_VERSION_MISMATCH"):
        return "the NVML library and the loaded driver differ in version (reboot or reload the driver)"
    return f"nvmlInit failed: {type(err).__name__}: {err}"


def acquire(ctx: Context) -> Any:
    """The NVML binding, initialised; pair with release()."""
    try:
        nvml = ctx.nvml_loader() if ctx.nvml_loader is not None else importlib.import_module("pynvml")
    except ImportError as e:
        raise Unavailable(f"the NVML binding is not installed (package nvidia-ml-py, module pynvml): {e}") from None
    except Exception as e:
        raise Unavailable(f"the NVML binding could not be loaded: {e!r}") from None
    with _lock:
        entry = _sessions.get(id(nvml))
        if entry is None:
            try:
                nvml.nvmlInit()
            except Exception as e:
                raise Unavailable(_init_failure(nvml, e)) from None
            _sessions[id(nvml)] = [nvml, 1]
        else:
            entry[1] += 1
    return nvml


def release(nvml: Any) -> None:
    with _lock:
        entry = _sessions.get(id(nvml))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _sessions[id(nvml)]
        try:
            nvml.nvmlShutdown()
        except Exception as e:  # at exit nobody can act on it
            log.debug("nvmlShutdown failed: %r", e)


# ------------------------------------------------------------------------------------------ GPUs
class Gpu:
    """One GPU of this rank, held by UUID; ``handle`` is refreshed by UUID after the GPU was lost."""

    __slots__ = ("index", "label", "uuid", "pci_bus_id", "model", "handle", "up")

    def __init__(self, index: int, uuid: str, pci_bus_id: str, model: str, handle: Any):
        self.index = index
        self.label = str(index)
        self.uuid = uuid
        self.pci_bus_id = pci_bus_id
        self.model = model
        self.handle = handle
        self.up = True

    def __repr__(self) -> str:
        return f"Gpu({self.index}, {self.uuid}, {self.pci_bus_id})"

    def pci_key(self) -> tuple[int | str, ...]:
        """Sort key in PCI bus id order (domain, bus, device, function), as CUDA_DEVICE_ORDER=PCI_BUS_ID."""
        m = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)", self.pci_bus_id.strip())
        if not m:
            return (1, self.pci_bus_id.lower(), self.index)
        return (0, *(int(part, 16) for part in m.groups()), self.index)


def enumerate_gpus(nvml: Any) -> list[Gpu]:
    """Every GPU NVML sees, in NVML index order; one that does not answer is left out with a warning."""
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception as e:
        raise Unavailable(f"NVML could not count the GPUs: {type(e).__name__}: {e}") from None
    gpus = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = text(nvml.nvmlDeviceGetUUID(handle))
            pci = text(nvml.nvmlDeviceGetPciInfo(handle).busId)
            model = text(nvml.nvmlDeviceGetName(handle))
        except Exception as e:
            log.warning("GPU %d does not answer NVML (%s: %s); it is left out", index, type(e).__name__, e)
            continue
        gpus.append(Gpu(index, uuid, pci, model, handle))
    return gpus


def _match_uuid(gpus: Sequence[Gpu], wanted: str) -> list[Gpu]:
    """GPUs whose UUID starts with ``wanted`` (CUDA accepts unique prefixes), case-insensitively."""
    w = wanted.strip().lower()
    if not w.startswith("gpu-"):
        w = "gpu-" + w
    return [g for g in gpus if g.uuid.lower().startswith(w)]


def _mig_parent(nvml: Any, gpus: Sequence[Gpu], token: str) -> Gpu | None:
    """The GPU that holds a MIG device: ``MIG-GPU-<uuid>/<gi>/<ci>`` (old form) or ``MIG-<uuid>``."""
    rest = token[4:]
    if rest.upper().startswith("GPU-"):
        hits = _match_uuid(gpus, rest.split("/")[0])
        return hits[0] if len(hits) == 1 else None
    try:
        mig = nvml.nvmlDeviceGetHandleByUUID(token)
        parent_uuid = text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)))
    except Exception:
        return None
    return next((g for g in gpus if g.uuid == parent_uuid), None)


def parse_cuda_visible(nvml: Any, gpus: Sequence[Gpu], value: str) -> list[Gpu]:
    """The GPUs of CUDA_VISIBLE_DEVICES in CUDA order; like CUDA, the list ends at the first invalid entry."""
    by_pci = sorted(gpus, key=Gpu.pci_key)
    out: list[Gpu] = []
    for raw in value.split(","):
        token = raw.strip()
        gpu: Gpu | None = None
        if re.fullmatch(r"[0-9]{1,9}", token):  # ASCII, bounded: a longer number is no GPU (int() of it raises)
            ordinal = int(token)
            gpu = by_pci[ordinal] if ordinal < len(by_pci) else None
        elif token.upper().startswith("MIG-"):
            gpu = _mig_parent(nvml, gpus, token)
        elif token.upper().startswith("GPU-"):
            hits = _match_uuid(gpus, token)
            gpu = hits[0] if len(hits) == 1 else None
        if gpu is None:
            if token:
                log.warning("CUDA_VISIBLE_DEVICES=%r: entry %r matches no single GPU here; CUDA ignores it and "
                            "every entry after it", value, token)
            break
        if gpu not in out:  # several MIG devices of one GPU: the GPU once
            out.append(gpu)
    return out


def _warn_if_order_ambiguous(gpus: Sequence[Gpu], environ: dict[str, str]) -> None:
    if environ.get("CUDA_DEVICE_ORDER", "") != "PCI_BUS_ID" and len({g.model for g in gpus}) > 1:
        log.warning("CUDA_VISIBLE_DEVICES indices are read in PCI bus order, but this node mixes GPU models and "
                    "CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may number them otherwise; use GPU UUIDs")


def select_gpus(nvml: Any, gpus: Sequence[Gpu], ctx: Context) -> list[Gpu]:
    """This rank's GPUs from ctx.config.gpus: auto | all | comma list of NVML indices or GPU UUIDs."""
    choice = (ctx.config.gpus or "auto").strip()
    if choice == "all":
        return list(gpus)
    if choice != "auto":
        picked: list[Gpu] = []
        for token in (t.strip() for t in choice.split(",") if t.strip()):
            if re.fullmatch(r"[0-9]{1,9}", token):
                hits = [g for g in gpus if g.index == int(token)]
                what = f"NVML index {token}"
            elif token.upper().startswith("MIG-"):
                parent = _mig_parent(nvml, gpus, token)
                hits = [parent] if parent else []
                what = f"MIG device {token}"
            else:
                hits = _match_uuid(gpus, token)
                what = f"UUID {token}"
            if len(hits) != 1:
                present = ", ".join(f"{g.index}={g.uuid}" for g in gpus) or "none"
                problem = "matches several GPUs" if hits else "is not here"
                raise GpuSelectionError(f"--gpus: {what} {problem} (GPUs present: {present})")
            if hits[0] not in picked:
                picked.append(hits[0])
        return picked

    visible = ctx.environ.get("CUDA_VISIBLE_DEVICES")
    rank = ctx.config.local_rank
    if visible is None:
        if rank is None:
            return list(gpus)
        by_pci = sorted(gpus, key=Gpu.pci_key)
        if 0 <= rank < len(by_pci):
            _warn_if_order_ambiguous(gpus, ctx.environ)
            return [by_pci[rank]]
        raise GpuSelectionError(f"local rank {rank} but only {len(by_pci)} GPU(s) here and CUDA_VISIBLE_DEVICES "
                                "is unset; pass --gpus")
    devices = parse_cuda_visible(nvml, gpus, visible)
    if not devices:
        raise Unavailable(f"CUDA_VISIBLE_DEVICES={visible!r} leaves no GPU visible to this rank")
    if any(re.fullmatch(r"\s*\d+\s*", t) for t in visible.split(",")):
        _warn_if_order_ambiguous(gpus, ctx.environ)
    if rank is None:
        return devices
    if 0 <= rank < len(devices):
        return [devices[rank]]
    if len(devices) == 1:  # a launcher (Ray) that shows each worker only its own GPU
        return devices
    raise GpuSelectionError(f"local rank {rank} but CUDA_VISIBLE_DEVICES={visible!r} names {len(devices)} GPU(s); "
                            "pass --gpus")


# ------------------------------------------------------------------------------------------ a session
class NvmlSession:
    """NVML opened for one collector: the binding, this rank's GPUs, and the classification of errors."""

    def __init__(self, ctx: Context):
        self.nvml = acquire(ctx)
        self._open = True
        try:
            n = self.nvml
            self.error_class: type[Exception] = n.NVMLError
            mismatch = getattr(n, "NVMLLibraryMismatchError", None)
            self._mismatch: tuple[type[Exception], ...] = (mismatch,) if mismatch else ()
            self._unsupported = {code(n, c) for c in ("NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "NO_PERMISSION",
                                                      "ARGUMENT_VERSION_MISMATCH")}
            self._lost = {code(n, c) for c in ("GPU_IS_LOST", "UNKNOWN", "UNINITIALIZED", "RESET_REQUIRED",
                                               "GPU_NOT_FOUND")}
            self.timeout_code = code(n, "TIMEOUT")
            self.invalid_argument_code = code(n, "INVALID_ARGUMENT")
            everything = enumerate_gpus(n)
            if not everything:
                raise Unavailable("NVML sees no GPU on this machine")
            self.gpus = select_gpus(n, everything, ctx)
            if not self.gpus:
                raise Unavailable("no GPU selected for this rank")
        except BaseException:
            self.close()
            raise

    def kind(self, err: BaseException) -> str:
        """UNSUPPORTED (NotSupported, a function this driver lacks, no permission), LOST or OTHER."""
        if isinstance(err, self.error_class):
            value = getattr(err, "value", None)
            if value in self._unsupported:
                return UNSUPPORTED
            if value in self._lost:
                return LOST
            return OTHER
        if self._mismatch and isinstance(err, self._mismatch):
            return UNSUPPORTED
        return OTHER

    def is_code(self, err: BaseException, value: int) -> bool:
        return isinstance(err, self.error_class) and getattr(err, "value", None) == value

    def reacquire(self, gpu: Gpu) -> bool:
        """A fresh handle for a GPU that was lost; True when NVML gives one."""
        try:
            gpu.handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        except Exception:
            return False
        return True

    def close(self) -> None:
        if self._open:
            self._open = False
            release(self.nvml)


class GpuLost(Exception):
    """Raised inside a collector's per-GPU read when NVML says the GPU is gone; never leaves sample()."""
