"""Persistent rank-pool runner for multi-rank unit tests.

Spawning a fresh ``torch.distributed`` process group for every test costs
seconds, so this module keeps one long-lived group of worker processes per
``(world_size, backend)`` and ships test bodies to it::

    import torch
    import torch.distributed as dist
    from fsdp_compat.testing import distributed_test

    @distributed_test(world_size=2)
    def test_allreduce():           # the body runs on every rank
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        assert t.item() == 3

Bodies are pickled *by reference*, so they must be module-level functions of
an importable module (``tests/__init__.py`` makes pytest import test files as
``tests.test_xxx``, which the spawned workers can import too).  Arguments and
return values are pickled by value; return CPU objects, not CUDA tensors.

Environment variables:

* ``FSDP_COMPAT_TEST_BACKEND`` -- force a backend (``gloo``/``nccl``).
* ``FSDP_COMPAT_TEST_THREADS`` -- ``torch.set_num_threads`` in workers
  (default 1; ``0`` leaves torch's default).
* ``FSDP_COMPAT_MAX_CPU_RANKS`` -- largest CPU world size before
  :func:`distributed_test` skips (default 8).
* ``FSDP_COMPAT_RANK_WORKER`` -- set to ``1`` inside workers (do not set it).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import multiprocessing.connection as mp_connection
import multiprocessing.util  # noqa: F401  (imported first so our atexit hook runs before its child-joining one)
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "RankFailure",
    "RankPool",
    "close_all_pools",
    "device",
    "distributed_test",
    "get_pool",
    "rank",
    "resolve_backend",
    "run_on_ranks",
    "world_size",
]

WORKER_ENV = "FSDP_COMPAT_RANK_WORKER"
BACKEND_ENV = "FSDP_COMPAT_TEST_BACKEND"
THREADS_ENV = "FSDP_COMPAT_TEST_THREADS"
MAX_CPU_RANKS_ENV = "FSDP_COMPAT_MAX_CPU_RANKS"

# A reply from a worker: (status, payload).  Statuses: "ready", "ok", "err",
# "skip" (pytest.skip raised in the body) and "died" (parent-side only).
_Reply = tuple[str, Any]
_F = TypeVar("_F", bound=Callable[..., Any])

_STOP = b"stop"  # raw sentinel message; never a valid pickle of a call
_STARTUP_ATTEMPTS = 3  # retries only for a lost race on the free port


class RankFailure(AssertionError):
    """One or more ranks failed, died or did not answer.

    Subclasses :class:`AssertionError` so pytest reports a test failure rather
    than an error.  ``failures`` maps each failing rank to its description
    (usually a formatted traceback).
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


# --------------------------------------------------------------------------
# Backend selection and small helpers usable inside bodies
# --------------------------------------------------------------------------


def resolve_backend(world_size: int, backend: str | None = None) -> str:
    """Return the backend a pool of ``world_size`` ranks would use.

    Explicit ``backend`` wins, then ``$FSDP_COMPAT_TEST_BACKEND``, then
    ``nccl`` when enough GPUs exist, else ``gloo``.
    """
    if backend:
        return backend
    env = os.environ.get(BACKEND_ENV)
    if env:
        return env
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _needs_cuda(backend: str) -> bool:
    # Covers plain "nccl" and composite specs such as "cpu:gloo,cuda:nccl".
    return "nccl" in backend


def rank() -> int:
    """Rank of the current process (0 outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """World size of the current process group (1 outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def device() -> torch.device:
    """Device for this rank's tensors: ``cuda:<local rank>`` on nccl, else cpu."""
    if dist.is_available() and dist.is_initialized() and _needs_cuda(dist.get_backend()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank())))
    return torch.device("cpu")


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def _send(conn: mp_connection.Connection, reply: _Reply) -> None:
    # Plain pickle (not multiprocessing's ForkingPickler) so tensors travel by
    # value instead of via torch's shared-memory/fd-passing reductions, which
    # need the sender to stay alive until the parent has read them.
    try:
        data = pickle.dumps(reply)
    except BaseException:  # unpicklable return value: report it, keep serving
        data = pickle.dumps(("err", "could not pickle the return value:\n" + traceback.format_exc()))
    conn.send_bytes(data)


def _exit_with_parent() -> None:
    """Kill this worker when the parent dies, even mid-collective."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="rank-pool-parent-watch", daemon=True).start()


def _adopt_environment(environment: dict[str, str]) -> None:
    """Take the parent's environment as it is now (a forkserver child starts with the server's, a
    snapshot from when the server started), as a spawned worker would have it."""
    for name in set(os.environ) - set(environment):
        del os.environ[name]
    os.environ.update(environment)


def _init_worker(rank_: int, world_size_: int, backend: str, port: int, threads: int) -> None:
    """Set the torchrun-style environment and join the process group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank_),
        WORLD_SIZE=str(world_size_),
        LOCAL_RANK=str(rank_),
        LOCAL_WORLD_SIZE=str(world_size_),
    )
    os.environ[WORKER_ENV] = "1"
    if threads > 0:
        torch.set_num_threads(threads)
    if _needs_cuda(backend):
        torch.cuda.set_device(rank_)
    dist.init_process_group(backend, rank=rank_, world_size=world_size_)


def _is_pytest_skip(exc: BaseException) -> bool:
    # A body that called pytest.skip has imported pytest already; looking the
    # module up (instead of importing it) keeps workers free of pytest.
    outcomes = sys.modules.get("_pytest.outcomes")
    return outcomes is not None and isinstance(exc, outcomes.Skipped)


def _run_body(data: bytes, rank_: int, backend: str) -> _Reply:
    """Unpickle and run one call, turning every outcome into a reply."""
    try:
        fn, args, kwargs = pickle.loads(data)
        # Fixed RNG state so a body's results do not depend on earlier tests.
        torch.manual_seed(0)
        if _needs_cuda(backend):
            torch.cuda.set_device(rank_)  # a previous body may have changed it
        with _as_in_a_fresh_process():
            return ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # pytest.fail/skip and SystemExit are BaseExceptions
        if _is_pytest_skip(exc):
            return ("skip", str(getattr(exc, "msg", exc)))
        # Drop this frame: the report should start at the body, not the harness.
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        return ("err", "".join(traceback.format_exception(type(exc), exc, tb)))


@contextlib.contextmanager
def _as_in_a_fresh_process() -> Iterator[None]:
    """Run a body as if its worker were new: the warning filters it installs are undone when it
    ends, warnings the library gives once per process may be given again, and a torch switch
    (``fsdp_compat.patch_torch``) the body left on is switched off."""
    from . import _common, patch  # here, not at import: the pool itself does not need the library

    _common.forget_warnings()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        if patch.is_torch_patched():
            patch.unpatch_torch()


def _worker_main(
    rank_: int,
    world_size_: int,
    backend: str,
    port: int,
    threads: int,
    conn: mp_connection.Connection,
    environment: dict[str, str],
) -> None:
    """Entry point of a pool worker: join the group, then serve calls."""
    # Ctrl-C goes to the whole process group; let the parent decide how to
    # tear the pool down instead of every rank dying with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        _adopt_environment(environment)
        _init_worker(rank_, world_size_, backend, port, threads)
    except BaseException:
        _send(conn, ("err", "process group initialisation failed:\n" + traceback.format_exc()))
        return
    _send(conn, ("ready", None))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # parent went away
            break
        if data == _STOP:
            break
        _send(conn, _run_body(data, rank_, backend))
    dist.destroy_process_group()


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _start_context() -> Any:
    """How workers are started: forked from multiprocessing's fork server, which imports this module
    (so torch and fsdp_compat) once for the whole session. A spawned worker spent seconds of CPU
    importing torch on every pool start and every restart after a failure; a forked one starts at
    once. The server is a fresh interpreter that only imports (no threads, no CUDA context, no
    process group), so forking it is as safe as spawning; each worker still takes the parent's
    current environment (:func:`_adopt_environment`)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # not on this platform
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts (the first pool start)
    return ctx


def _free_port() -> int:
    """Ask the OS for a currently unused TCP port on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_threads() -> int:
    # Default 1: up to 4 ranks share 2 cores, and oversubscribed intra-op
    # threads make collectives-heavy tests dramatically slower.
    return int(os.environ.get(THREADS_ENV, "1") or "1")


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"died with exit code {exitcode}"


def _fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_LIVE_POOLS: weakref.WeakSet[RankPool] = weakref.WeakSet()


class RankPool:
    """A long-lived group of ``world_size`` ranks that runs functions on demand.

    Workers are started with the multiprocessing *forkserver* context (see
    :func:`_start_context`) and join a ``torch.distributed`` process group once; :meth:`run` then sends the same
    call to every rank.  After any failure the pool is torn down and the next
    :meth:`run` transparently starts a fresh one, because surviving ranks may
    be stuck in a collective that can never complete.

    Args:
        world_size: number of ranks.
        backend: process-group backend; see :func:`resolve_backend`.
        timeout: default seconds to wait for startup and for each call.
        grace: seconds to wait for the remaining ranks once one has failed.
    """

    def __init__(
        self, world_size: int, backend: str | None = None, timeout: float = 180.0, *, grace: float = 5.0
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = resolve_backend(world_size, backend)
        self.timeout = timeout
        self.grace = grace
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[mp_connection.Connection] = []
        self._closed = False
        _LIVE_POOLS.add(self)
        self._start()

    # -- lifecycle ---------------------------------------------------------

    @property
    def started(self) -> bool:
        """True while worker processes exist; False after a teardown or close."""
        return bool(self._procs)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`; a closed pool cannot run anything."""
        return self._closed

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the current workers, in rank order."""
        return [p.pid for p in self._procs]

    def ensure_started(self) -> None:
        """Start workers if the pool was torn down after a failure."""
        if self._closed:
            raise RuntimeError("RankPool is closed")
        if not self._procs:
            self._start()

    def _start(self) -> None:
        for attempt in range(_STARTUP_ATTEMPTS):
            try:
                self._spawn_and_handshake()
                return
            except RankFailure as exc:
                # The port is picked by the parent and bound later by rank 0,
                # so another process can grab it in between; retry only that.
                if "address already in use" not in str(exc).lower() or attempt + 1 == _STARTUP_ATTEMPTS:
                    raise

    def _spawn_and_handshake(self) -> None:
        ctx = _start_context()
        port, threads = _free_port(), _worker_threads()
        try:
            self._spawn_workers(ctx, port, threads)
            replies = self._gather(self.timeout)
        except BaseException:  # never leave half a pool running
            self._kill()
            raise
        if len(replies) < self.world_size or any(s != "ready" for s, _ in replies.values()):
            self._kill()
            raise self._failure(f"starting {self.world_size} ranks ({self.backend})", replies, self.timeout)

    def _spawn_workers(self, ctx: Any, port: int, threads: int) -> None:
        for r in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(r, self.world_size, self.backend, port, threads, child_end, dict(os.environ)),
                name=f"rank-pool-{self.world_size}-rank{r}",
            )
            proc.start()
            child_end.close()  # so EOF on parent_end means the worker is gone
            self._procs.append(proc)
            self._conns.append(parent_end)

    def close(self, timeout: float = 30.0) -> None:
        """Stop workers cleanly; kill any that do not exit within ``timeout`` (generous: a worker
        tearing down its process group took over 5 s on 2 cores under a load average of 6)."""
        self._closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(_STOP)
            except OSError:
                pass  # worker already gone
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        """Tear the pool down hard; the next :meth:`run` restarts it."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._procs else "stopped")
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -- running -----------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return results in rank order.

        ``fn`` must be picklable by reference (a module-level function).
        Raises :class:`RankFailure` if any rank raises, dies or does not
        answer within ``timeout`` seconds (default: the pool's timeout).  If
        every rank that did not succeed called ``pytest.skip``, the skip is
        re-raised in the caller.
        """
        __tracebackhide__ = True  # pytest: show the RankFailure, not harness frames
        return self.call(fn, args, kwargs, timeout=timeout)

    def call(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Like :meth:`run` but with explicit ``args``/``kwargs``.

        Useful when the body itself takes a keyword named ``timeout``.
        """
        __tracebackhide__ = True
        data = self._pickle_call(fn, args, kwargs or {})
        self.ensure_started()
        timeout = self.timeout if timeout is None else timeout
        try:
            for conn in self._conns:
                conn.send_bytes(data)
            replies = self._gather(timeout)
        except BaseException:  # e.g. Ctrl-C: workers are mid-call, unusable
            self._kill()
            raise
        return self._finish(fn, replies, timeout)

    @staticmethod
    def _pickle_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        # Pickle once in the parent so an unpicklable call fails here, with the
        # pool still healthy, instead of on every rank.
        try:
            return pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"cannot send {_fn_name(fn)} to the rank pool: the function must be defined at module "
                f"level and its arguments must be picklable ({exc})"
            ) from exc

    def _finish(self, fn: Callable[..., Any], replies: dict[int, _Reply], timeout: float) -> list[Any]:
        """Turn the gathered replies into results, a skip, or a RankFailure."""
        __tracebackhide__ = True
        statuses = {status for status, _ in replies.values()}
        if len(replies) == self.world_size and statuses <= {"ok", "skip"}:
            if "skip" in statuses:  # all ranks returned normally, pool healthy
                _pytest_skip(next(p for s, p in replies.values() if s == "skip"))
            return [replies[r][1] for r in range(self.world_size)]
        self._kill()
        raise self._failure(_fn_name(fn), replies, timeout)

    def _gather(self, timeout: float) -> dict[int, _Reply]:
        """Collect one reply per rank until all answered or time runs out.

        The first failure shortens the deadline to ``grace`` seconds: peers of
        a failed rank are often blocked in a collective that will never end.
        """
        replies: dict[int, _Reply] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # Waiting on the process sentinels too means a crashed worker is
            # noticed immediately rather than at the timeout.
            waitables: dict[Any, int] = {}
            for r in range(self.world_size):
                if r not in replies:
                    waitables[self._conns[r]] = r
                    waitables[self._procs[r].sentinel] = r
            for ready in mp_connection.wait(list(waitables), timeout=remaining):
                r = waitables[ready]
                if r not in replies:
                    replies[r] = self._read_reply(r)
            if any(status not in ("ok", "ready") for status, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + self.grace)
        return replies

    def _read_reply(self, r: int) -> _Reply:
        conn, proc = self._conns[r], self._procs[r]
        try:
            if conn.poll():
                data = conn.recv_bytes()
            else:
                data = None
        except (EOFError, OSError):
            data = None
        if data is None:  # the process exited without answering
            proc.join(1.0)  # let the exit code settle
            return ("died", f"worker process {_describe_exit(proc.exitcode)}")
        try:
            return pickle.loads(data)
        except BaseException:
            return ("err", "could not unpickle the reply in the parent:\n" + traceback.format_exc())

    def _failure(self, what: str, replies: dict[int, _Reply], timeout: float) -> RankFailure:
        """Build a RankFailure naming every failing, dead and silent rank."""
        failures: dict[int, str] = {}
        for r in range(self.world_size):
            status, payload = replies.get(r, ("missing", None))
            if status in ("err", "died"):
                failures[r] = str(payload)
            elif status == "skip":
                failures[r] = f"called pytest.skip({payload!r}) while other ranks failed"
            elif status == "missing":
                failures[r] = self._missing_reason(replies, timeout)
        ranks = ", ".join(map(str, failures))
        lines = [
            f"{what}: {len(failures)} of {self.world_size} rank(s) failed (rank {ranks}); "
            "pool torn down, the next call restarts it"
        ]
        for r, text in failures.items():
            lines.append(f"\n----- rank {r} -----\n{text.rstrip()}")
        return RankFailure("\n".join(lines), failures)

    def _missing_reason(self, replies: dict[int, _Reply], timeout: float) -> str:
        if any(status not in ("ok", "ready") for status, _ in replies.values()):
            return (
                f"did not answer within the {self.grace:g}s grace period after another rank failed "
                "(probably blocked in a collective); killed"
            )
        return f"did not answer within the {timeout:g}s timeout; killed"


def _pytest_skip(reason: str) -> None:
    __tracebackhide__ = True
    import pytest  # lazy: only reachable when a worker already used pytest

    pytest.skip(reason)


# --------------------------------------------------------------------------
# Pool cache
# --------------------------------------------------------------------------

_POOLS: dict[tuple[int, str], RankPool] = {}


def get_pool(world_size: int, backend: str | None = None) -> RankPool:
    """Return the shared, started pool for ``(world_size, backend)``.

    A pool torn down after a failure is restarted; a closed one is replaced.
    """
    key = (world_size, resolve_backend(world_size, backend))
    pool = _POOLS.get(key)
    if pool is None or pool.closed:
        pool = _POOLS[key] = RankPool(world_size, key[1])
    pool.ensure_started()
    return pool


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of the shared pool; see :meth:`RankPool.run`."""
    __tracebackhide__ = True
    return get_pool(world_size).call(fn, args, kwargs)


def close_all_pools() -> None:
    """Close every live pool (registered with :mod:`atexit`)."""
    for pool in list(_LIVE_POOLS):
        if not pool.closed:
            pool.close()
    _POOLS.clear()


# Registered after importing multiprocessing.util, so it runs before
# multiprocessing's own exit hook, which would otherwise join our
# (non-daemonic) workers forever.
atexit.register(close_all_pools)


# --------------------------------------------------------------------------
# pytest decorator
# --------------------------------------------------------------------------


def _skip_reason(world_size_: int, backend: str) -> str | None:
    """Why a test of this size cannot run on this machine, or None."""
    if _needs_cuda(backend):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world_size_:
            return f"backend {backend!r} needs {world_size_} GPUs, found {gpus}"
        return None
    limit = int(os.environ.get(MAX_CPU_RANKS_ENV, "8"))
    if world_size_ > limit:
        return f"world_size {world_size_} exceeds {MAX_CPU_RANKS_ENV}={limit} CPU ranks"
    return None


def distributed_test(
    world_size: int | Callable[..., Any] = 2, *, timeout: float | None = None, backend: str | None = None
) -> Any:
    """Decorate a pytest test so its body runs on every rank of a shared pool.

    In the pytest process the wrapper forwards the call to
    ``get_pool(world_size, backend)``; inside a worker it simply runs the body.
    The pool pickles the *wrapper* by module and qualified name, which is what
    the test module's attribute holds, so the worker finds the same function.

    Only picklable arguments are supported, i.e. ``pytest.mark.parametrize``
    values; pytest fixtures are not (they would be created in the parent only).
    Any return value is discarded.  Skips the test when the backend needs more
    GPUs than exist or ``world_size`` exceeds ``$FSDP_COMPAT_MAX_CPU_RANKS``.
    Also usable bare as ``@distributed_test`` (two ranks).
    """
    if callable(world_size):  # bare @distributed_test
        return distributed_test()(world_size)
    size = world_size

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True
            if os.environ.get(WORKER_ENV) == "1":
                return fn(*args, **kwargs)
            reason = _skip_reason(size, resolve_backend(size, backend))
            if reason is not None:
                _pytest_skip(reason)
            # call() rather than run(): a body may take a parameter named "timeout".
            get_pool(size, backend).call(wrapper, args, kwargs, timeout=timeout)
            return None

        return wrapper  # type: ignore[return-value]

    return decorate
