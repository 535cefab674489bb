"""One OpenMP team at a time, so torch's CPU kernels keep their speed in a process that runs the
model from several threads (a server: its requests, the decode loop, deposits, the thread that
loaded the model).

PyTorch's Linux wheels run their CPU kernels on GNU OpenMP (libgomp). Every OS thread that runs a
parallel kernel becomes the master of a team of its own, whose worker threads stay alive after
it. Once the process holds more OpenMP threads than it has CPUs, libgomp's waiting workers stop
spinning between parallel regions (its "throttled" spin count, 100 iterations) and sleep
instead, so each of the thousand parallel regions of a decode step pays a futex wake-up. Measured
on the 2-core EPYC VM (2026-12-04, torch 2.13.0, bf16): a decode step of 7 sequences took 32-42 ms
on the thread that loaded the model, 73-110 ms on another thread while the first one's team was
idle, and 32.5 ms there once that team was released; in the server, the decode loop's steps of 7
took 75-85 ms.

ModelLock, the Memory's lock, therefore releases the calling thread's team
(`omp_pause_resource_all`, OpenMP 5.0: libgomp frees the calling thread's pool only) when the
thread lets go of the lock, and before it waits to take it: only the thread holding the model has
a team, and a thread's next parallel region starts its team again (tens of microseconds). The
kernels, their thread count and so their bits are unchanged. Where torch's OpenMP runtime is not
a libgomp with that function (another platform or runtime), `release` does nothing and says so."""

from __future__ import annotations

import ctypes
import importlib
import threading

OMP_PAUSE_SOFT = 1
_pause = None                    # the runtime's omp_pause_resource_all, False where there is none


def _find():
    """libgomp's omp_pause_resource_all, from the copy this process has mapped (torch's own), or False."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = sorted({line.split(None, 5)[5].strip() for line in f
                            if len(line.split(None, 5)) == 6 and "libgomp" in line})
    except OSError:
        return False
    for path in paths:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return False


def available() -> bool:
    """Whether `release` can free a thread's OpenMP team here."""
    global _pause
    if _pause is None:
        importlib.import_module("torch")          # its OpenMP runtime mapped before looking for it
        _pause = _find()
    return bool(_pause)


def release() -> bool:
    """Free the calling thread's OpenMP team (its worker threads end); its next parallel kernel
    starts one again. True where done (or there was none), False where the runtime cannot."""
    return available() and _pause(OMP_PAUSE_SOFT) == 0


class ModelLock:
    """A re-entrant lock (threading.RLock's interface, with the private methods that
    threading.Condition and kvmemory.batching.let_go use) whose holder is the only thread with an
    OpenMP team: a thread's team is released when it lets go of the lock for good and before it
    waits for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock._is_owned():
            release()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()
        if not self._lock._is_owned():
            release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()

    def _release_save(self):
        state = self._lock._release_save()
        release()
        return state

    def _acquire_restore(self, state) -> None:
        release()
        self._lock._acquire_restore(state)
