"""Run a test body on N CPU ranks (gloo) under plain pytest.

    from multirank import multirank, run_ranks

    @multirank(2, 4)                 # a pytest test per world size
    def test_all_reduce():
        ...                          # runs on every rank; torch.distributed is initialised (gloo)

    results = run_ranks(fn, 4, x, timeout=60)   # fn(x) on 4 ranks, list of per-rank return values

Ranks are kept alive between tests (one pool of processes per world size) because starting Python + torch is
the slow part on a 2-core machine. A test that raises on any rank fails with that rank's traceback; a test that
does not finish within ``timeout`` seconds fails naming the ranks still running, with their Python stacks
(faulthandler), and the pool is torn down so the next test starts clean. Workers run the default process group
with the same environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). After each test
the ranks destroy the process groups it created (gloo keeps I/O threads per group, and hundreds of idle ones cost
a 2-core machine a good part of a core), and a rank still holding more than MAX_THREADS threads retires its pool.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import pytest

DEFAULT_TIMEOUT = float(os.environ.get("LLMPAR_TEST_TIMEOUT", "120"))
STARTUP_TIMEOUT = 180.0
CLEANUP_TIMEOUT = 60.0  # seconds the ranks get to drop a passed test's groups before the pool is replaced
ERROR_GRACE = 3.0  # seconds the other ranks get to report after one rank failed


class RankFailure(AssertionError):
    """A rank raised (or died) while running a test body."""


class RankTimeout(RankFailure):
    """Some ranks did not finish within the timeout."""


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_sys_path() -> list[str]:
    """This process's ``sys.path`` without the clone's root (nor ``''`` standing for it as the working directory):
    the ranks import llmpar as installed, as a launched job's ranks do, and the top-level ``kernels/`` folder is never
    found under the bare name ``kernels`` (HF's package of that name, which transformers imports)."""
    return [p for p in sys.path if os.path.abspath(p or os.curdir) != REPO_ROOT]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a torchrun --master_port or a store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(module: str, qualname: str) -> Callable:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__multirank_body__", obj)


def _worker(rank: int, world_size: int, port: int, store_path: str, tasks, results, sys_path, log_path) -> None:
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    sys.path[:] = sys_path
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=900),
        )
    except BaseException:
        results.put(("ready", rank, "error", traceback.format_exc()))
        return
    results.put(("ready", rank, "ok", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, module, qualname, args, kwargs = task
        kept = set(_groups())
        try:
            value = _resolve(module, qualname)(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            # the parent tears the pool down on any rank's error: no cleanup follows
            results.put((task_id, rank, "error", traceback.format_exc()))
            if not dist.is_initialized():
                results.put((task_id, rank, "closed", None))
                break
            continue
        results.put((task_id, rank, "ok", value))
        # then the cleanup, which the parent waits for once every rank reported: drop the groups the body made;
        # a body that tore the default group down, or left threads behind that would keep burning CPU while the
        # pool idles, retires the pool
        if dist.is_initialized() and not _drop_groups(kept):
            dist.destroy_process_group()
        value = None
        if _threads() > MAX_THREADS:  # threads of groups still held in reference cycles end with a collection
            gc.collect()
        retire = not dist.is_initialized() or _threads() > MAX_THREADS or _hashed_groups_left()
        if retire and os.environ.get("LLMPAR_POOL_LOG"):
            with open(os.environ["LLMPAR_POOL_LOG"], "a") as f:
                f.write(f"{world_size} ranks, rank {rank}: retired after {module}.{qualname} ({_threads()} threads)\n")
        results.put((("cleanup", task_id), rank, "ok", retire))
        # a retiring rank still waits for the parent's close (None): tensors in its result travel as shared
        # memory that the parent can open only while this process lives
    if dist.is_initialized():
        dist.destroy_process_group()


MAX_THREADS = 64  # a worker left with more threads than this after a test is retired (see _worker)


def _groups() -> list:
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def _hashed_groups_left() -> bool:
    """Whether a group named by a hash of its ranks outlived the test (one made with ``use_local_synchronization``,
    which :func:`_droppable_all` keeps). torch hashes the ranks with the number of live groups, so once the test's other
    groups are destroyed and that number falls back, a later group of the same ranks gets the kept group's name and
    ``new_group`` refuses it ("group name has already been created"): such a worker is retired, the next test starts
    on fresh ranks."""
    from torch.distributed import distributed_c10d as c10d

    return any(not str(name).isdigit() for name in c10d._world.pg_names.values())


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _droppable_all(pgs: list, listed: list) -> list:
    """The groups of ``pgs`` that may be destroyed: named by torch's counter (a group made with
    ``use_local_synchronization`` is named by a hash of its ranks, and a later group of the same ranks would read the
    dead one's addresses from the store under that name), and referenced only by torch's registry (not by a cache
    that outlives the test, such as DeepSpeed's world-group clone). One scan of the heap for all of them (a scan per
    group, ``gc.get_referrers(pg)``, took a good part of a second per test on a 2-core machine)."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    named = [pg for pg in pgs if str(world.pg_names.get(pg, "")).isdigit()]
    if not named:
        return []
    registry = [
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.pg_coalesce_state,
        listed,
        pgs,
        named,
        *world.tags_to_pg.values(),
    ]
    ours = {id(x) for x in registry} | {id(sys._getframe()), id(sys._getframe(1))}
    wanted = {id(pg) for pg in named}
    held = set()  # groups referenced from outside torch's registry
    for referrer in gc.get_referrers(*named):
        if id(referrer) not in ours:
            held |= {id(x) for x in gc.get_referents(referrer)} & wanted
    return [pg for pg in named if id(pg) not in held]


def _drop_groups(kept: set) -> bool:
    """Destroy the process groups a test body created (each holds gloo I/O threads that otherwise live, and poll,
    for the rest of the session), except those :func:`_droppable_all` keeps. Every rank first passes a barrier on the
    default group (all of them, whether or not they belong to a new group), so no peer is still using them. False if
    that failed."""
    import torch.distributed as dist

    try:
        dist.barrier()
        if any(pg not in kept for pg in _groups()):  # a body that made no group leaves nothing to drop
            gc.collect()  # engines in reference cycles still hold the groups they made
        listed = _groups()
        for pg in _droppable_all([pg for pg in listed if pg not in kept], listed):
            dist.destroy_process_group(pg)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        return False
    return True


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        self.world_size = world_size
        self.tmp = tempfile.TemporaryDirectory(prefix=f"llmpar-ranks{world_size}-")
        store = os.path.join(self.tmp.name, "store")
        self.logs = [os.path.join(self.tmp.name, f"rank{r}.log") for r in range(world_size)]
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                name=f"llmpar-rank{r}",
                args=(r, world_size, port, store, self.tasks[r], self.results, worker_sys_path(), self.logs[r]),
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.task_id = 0
        self.early: list[tuple[int, str, Any]] = []  # cleanup replies that came before the task's last result
        self.alive = True
        replies = self._collect("ready", STARTUP_TIMEOUT, "start-up")
        errors = {r: tb for r, (status, tb) in replies.items() if status != "ok"}
        if errors:
            self.close()
            raise RankFailure(self._format_errors("start-up", errors))

    def _log_tail(self, rank: int, chars: int = 3000) -> str:
        try:
            with open(self.logs[rank]) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def _format_errors(self, what: str, errors: dict[int, str]) -> str:
        lines = [f"{what} failed on rank(s) {sorted(errors)} of {self.world_size}:"]
        for rank, tb in sorted(errors.items()):
            lines.append(f"\n----- rank {rank} traceback -----\n{tb}")
            tail = self._log_tail(rank, 1500).strip()
            if tail:
                lines.append(f"----- rank {rank} output (tail) -----\n{tail}")
        return "\n".join(lines)

    def _collect(self, task_id, timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        replies: dict[int, tuple[str, Any]] = {}
        if task_id == ("cleanup", self.task_id):
            replies.update({rank: (status, payload) for rank, status, payload in self.early})
        self.early = []
        exited: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            if any(s == "error" for s, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + ERROR_GRACE)
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                tid, rank, status, payload = self.results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                # a rank that exits right after its last message (a retiring pool) can be found dead while that
                # message is still in the pipe: it is reported dead only when a further poll brought nothing
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in replies]
                for r in dead:
                    if r in exited:
                        code = self.procs[r].exitcode
                        replies[r] = ("error", f"rank {r} process died (exit code {code}) during {what}\n")
                exited.update(dead)
                continue
            if tid != task_id:
                # a fast rank's cleanup reply can come while a slower rank's large result is still in the pipe:
                # kept for the cleanup's collect (dropped, it cost that collect its whole timeout); else a late
                # reply of an earlier, abandoned task
                if tid == ("cleanup", self.task_id):
                    self.early.append((rank, status, payload))
                continue
            if status == "closed":
                self.alive = False
                continue
            replies[rank] = (status, payload)
        return replies

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(f"the test body {fn!r} must be a module-level function (the ranks import it by name)")
        self.task_id += 1
        name = f"{module}.{qualname}"
        for q in self.tasks:
            q.put((self.task_id, module, qualname, args, kwargs))
        replies = self._collect(self.task_id, timeout, name)
        errors = {r: p for r, (s, p) in replies.items() if s != "ok"}
        missing = [r for r in range(self.world_size) if r not in replies]
        if missing:
            stacks = self._dump_stacks(missing)
            self.close()
            done = sorted(replies)
            header = (
                f"{name} on {self.world_size} ranks did not finish within {timeout:.0f}s: "
                f"rank(s) {missing} still running" + (f", rank(s) {done} finished" if done else "")
            )
            if errors:
                header += "\n" + self._format_errors(name, errors)
            raise RankTimeout(header + "\n" + stacks)
        if errors:
            msg = self._format_errors(name, errors)
            self.close()
            raise RankFailure(msg)
        cleanup = self._collect(("cleanup", self.task_id), CLEANUP_TIMEOUT, f"{name} cleanup")
        if len(cleanup) < self.world_size or any(s != "ok" or retire for s, retire in cleanup.values()):
            self.close()  # the next test gets a fresh pool
        return [replies[r][1] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> str:
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        return "\n".join(f"----- rank {r} stack and output (tail) -----\n{self._log_tail(r)}" for r in ranks)

    def close(self) -> None:
        if not self.alive and not any(p.is_alive() for p in self.procs):
            return
        _RETIRED_CPU[0] += sum(cpu_seconds(p.pid) for p in self.procs if p.pid and p.is_alive())
        self.alive = False
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.tmp.cleanup()


_POOLS: dict[int, _Pool] = {}
RUNS = 0  # bodies run so far in this process (tests/suite_rules.py tells a unit test that used the harness)
_RETIRED_CPU = [0.0]  # CPU seconds of the ranks of the pools closed so far


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (0 where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def workers_cpu() -> float:
    """CPU seconds the ranks of this process's pools have used, those alive and those retired (the ranks are not
    this process's children: its own CPU times never include them). tests/suite_rules.py counts them as the running
    test's own when it judges the durations budget."""
    return _RETIRED_CPU[0] + sum(cpu_seconds(p.pid) for pool in _POOLS.values() for p in pool.procs if p.pid)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; returns the per-rank results (rank order)."""
    global RUNS
    if not 1 <= world_size <= 16:
        raise ValueError(f"world_size={world_size} is outside [1, 16]")
    RUNS += 1
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    finally:
        if not pool.alive:
            _POOLS.pop(world_size, None)


def close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(close_pools)


def multirank(*world_sizes: int, timeout: float = DEFAULT_TIMEOUT) -> Callable[[Callable[[], Any]], Callable]:
    """Decorator: turn a module-level body ``f()`` into a pytest test run on each of ``world_sizes`` ranks."""
    if not world_sizes:
        raise ValueError("multirank needs at least one world size, e.g. @multirank(2, 4)")

    def decorate(body: Callable[[], Any]) -> Callable:
        def test(world_size: int) -> None:
            run_ranks(test, world_size, timeout=timeout)

        test.__name__ = body.__name__
        test.__qualname__ = body.__qualname__
        test.__module__ = body.__module__
        test.__doc__ = body.__doc__
        test.__multirank_body__ = body  # what the ranks run when they resolve the name
        return pytest.mark.parametrize("world_size", world_sizes)(test)

    return decorate
