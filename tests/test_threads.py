"""kvmemory/threads.py: the Memory's lock leaves an OpenMP team only to the thread holding it, so a
server's decode loop does not share the CPUs with idle teams (libgomp then stops spinning and every
parallel region of a step pays a wake-up; the speed is measured in benchmarks/bench_serve.py)."""

import os
import threading

import pytest
import torch

from kvmemory import threads

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2
                                or not threads.available(),
                                reason="needs Linux, torch on GNU OpenMP with omp_pause_resource_all, 2+ threads")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel() -> None:
    """A kernel torch runs on its OpenMP team (a reduction far above its grain size)."""
    x = torch.arange(1 << 22, dtype=torch.float32)
    assert float(x.sum()) > 0


def _in_thread(fn):
    out, err = [], []

    def run():
        try:
            out.append(fn())
        except BaseException as e:      # noqa: BLE001 -- re-raised in the test's thread
            err.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def test_release_ends_the_calling_threads_team_and_its_next_kernel_starts_one():
    def run():
        base = _os_threads()
        _parallel()
        with_team = _os_threads()
        assert threads.release() is True
        after = _os_threads()
        _parallel()
        again = _os_threads()
        threads.release()
        return base, with_team, after, again
    base, with_team, after, again = _in_thread(run)
    assert with_team > base                   # the thread's team: its worker threads
    assert after == base                      # released: they ended
    assert again == with_team                 # the next kernel started a team again
    assert threads.release() is True          # a thread without a team: nothing to do, no error


def test_the_model_lock_releases_a_threads_team_when_it_lets_go_for_good():
    from kvmemory.batching import let_go
    lock = threads.ModelLock()

    def run():
        base = _os_threads()
        seen = {}
        with lock:
            with lock:                        # re-entrant: the inner exit keeps the team
                _parallel()
            seen["inner exit"] = _os_threads()
            with let_go(lock):                # waiting for others (the batcher's decode): released
                assert not lock._is_owned()
                seen["let go"] = _os_threads()
            assert lock._is_owned()
            _parallel()
            seen["held"] = _os_threads()
        seen["released"] = _os_threads()
        _parallel()                           # work outside the lock starts a team ...
        seen["outside"] = _os_threads()
        assert lock.acquire()                 # ... which goes before the thread takes the lock
        seen["acquired"] = _os_threads()
        lock.release()
        return base, seen
    base, seen = _in_thread(run)
    assert seen["inner exit"] > base and seen["held"] > base and seen["outside"] > base
    assert seen["let go"] == seen["released"] == seen["acquired"] == base
    assert not lock._is_owned()
    with pytest.raises(RuntimeError):         # RLock's contract: releasing what one does not hold
        lock.release()


def test_a_thread_waits_for_the_model_lock_while_another_holds_it():
    lock = threads.ModelLock()
    inside, go = threading.Event(), threading.Event()
    order = []

    def holder():
        with lock:
            inside.set()
            go.wait(5)
            order.append("holder")
    t = threading.Thread(target=holder)
    t.start()
    inside.wait(5)
    assert not lock.acquire(timeout=0.05)     # held by the other thread
    go.set()
    with lock:
        order.append("waiter")
    t.join()
    assert order == ["holder", "waiter"]


@pytest.mark.real_model
def test_a_memory_and_its_server_keep_one_team(tmp_path):
    """A Memory's lock is a ModelLock, and the thread that built it (loading the model) and a
    server's request threads have no team left after their work."""
    import kvmemory
    from kvmemory.server.worker import _released

    mem = _in_thread(lambda: kvmemory.Memory(tmp_path / "s.kvm"))
    try:
        assert isinstance(mem.exclusive(), threads.ModelLock)

        def build_and_count():
            base = _os_threads()
            m = kvmemory.Memory(tmp_path / "s.kvm", read_only=True)    # loads the model here: kernels ran
            n = _os_threads()
            m.close()
            return base, n
        base, n = _in_thread(build_and_count)
        assert n <= base          # no team left (another thread of the process may end meanwhile)

        def job():
            base = _os_threads()
            _released(_parallel)              # a pool thread's job: outside the lock, released after
            return base, _os_threads()
        base, n = _in_thread(job)
        assert n <= base          # no team left (another thread of the process may end meanwhile)
    finally:
        mem.close()
