"""The version locks: no deadlock with nested calls, no stall behind a waiting apply (no Ray)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

from raysync.receivers.locks import WRITER_PRIORITY_S, AsyncRWLock, RWLock


def test_a_method_waiting_for_its_own_pool_call_does_not_deadlock_with_an_apply() -> None:
    lock = RWLock()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    applied = threading.Event()
    inner_ran = threading.Event()

    def inner() -> None:
        with lock.read():  # another public method, from the pool thread
            inner_ran.set()

    def method() -> None:
        with lock.read():
            while not lock.writers_waiting():  # an apply arrives mid-call
                time.sleep(0.001)
            pool.submit(inner).result(timeout=5)

    def apply() -> None:
        with lock.write():
            applied.set()

    caller = threading.Thread(target=method)
    caller.start()
    while not lock.readers():
        time.sleep(0.001)
    threading.Thread(target=apply).start()
    caller.join(timeout=5)
    assert not caller.is_alive() and inner_ran.is_set()
    assert applied.wait(5)


def test_new_calls_wait_at_most_the_priority_window_behind_a_waiting_apply() -> None:
    lock = RWLock()
    release = threading.Event()

    def long_method() -> None:
        with lock.read():
            release.wait(5)

    threading.Thread(target=long_method).start()
    while not lock.readers():
        time.sleep(0.001)
    writer = threading.Thread(target=lambda: lock.write().__enter__())
    writer.start()
    while not lock.writers_waiting():
        time.sleep(0.001)
    t0 = time.monotonic()
    with lock.read():  # a short call while the long one runs and the apply waits
        waited = time.monotonic() - t0
    assert waited < WRITER_PRIORITY_S + 2.0  # not the long call's 5 s
    release.set()
    writer.join(timeout=5)
    assert not writer.is_alive()  # the apply got in once the long call ended


def test_an_apply_from_inside_a_method_steps_out_of_its_read() -> None:
    lock = RWLock()
    with lock.read():
        assert lock.held()
        with lock.write():  # raysync_sync() called from a user method
            pass
        assert lock.held() and lock.readers() == 1
    assert lock.readers() == 0


def test_async_lock_lets_nested_tasks_in_and_applies_after() -> None:
    async def main() -> list[str]:
        lock = AsyncRWLock()
        events: list[str] = []

        async def inner() -> None:
            async with lock.read():
                events.append("inner")

        async def method() -> None:
            async with lock.read():
                await asyncio.sleep(0.05)  # the apply arrives meanwhile
                await asyncio.create_task(inner())  # a task it starts inherits its read
                events.append("method")

        async def apply() -> None:
            await asyncio.sleep(0.01)
            async with lock.write():
                events.append("apply")

        await asyncio.wait_for(asyncio.gather(method(), apply()), 5)
        return events

    assert asyncio.run(main()) == ["inner", "method", "apply"]
