"""Tests for the persistent rank-pool harness in :mod:`fsdp_compat.testing`."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_compat.testing import (
    RankFailure,
    RankPool,
    device,
    distributed_test,
    get_pool,
    resolve_backend,
    rank,
    run_on_ranks,
    world_size,
)

# ---------------------------------------------------------------------------
# Bodies shipped to the workers (module level so they pickle by reference)
# ---------------------------------------------------------------------------


def _whoami(tag: str) -> tuple[int, int, str, str]:
    return dist.get_rank(), dist.get_world_size(), os.environ["FSDP_COMPAT_RANK_WORKER"], tag


def _pid() -> int:
    return os.getpid()


def _allreduce_sum() -> float:
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item()


def _raise_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    return dist.get_rank()


def _raise_while_peer_in_collective() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 bails out before the collective")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is missing


def _sleep_on(slow_rank: int, seconds: float) -> int:
    if dist.get_rank() == slow_rank:
        time.sleep(seconds)
    return dist.get_rank()


def _exit_on(bad_rank: int, code: int) -> int:
    if dist.get_rank() == bad_rank:
        os._exit(code)
    return dist.get_rank()


def _random_value() -> float:
    return torch.rand(1).item()


def _skip_everywhere() -> None:
    pytest.skip("not applicable on any rank")


def _unpicklable_result() -> object:
    return lambda: None


# ---------------------------------------------------------------------------
# Happy paths
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_run_returns_per_rank_results(ws: int) -> None:
    assert run_on_ranks(_whoami, ws, "x") == [(r, ws, "1", "x") for r in range(ws)]


def test_get_pool_is_cached_and_collectives_work() -> None:
    pool = get_pool(2)
    assert get_pool(2) is pool and pool.backend == resolve_backend(2)
    assert pool.run(_allreduce_sum) == [3.0, 3.0]


def test_rng_is_reset_before_every_body() -> None:
    first = run_on_ranks(_random_value, 2)
    run_on_ranks(_random_value, 2)  # would advance the RNG without the reset
    assert run_on_ranks(_random_value, 2) == first


@distributed_test(world_size=2)
def test_decorated_allreduce() -> None:
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    assert t.item() == 3


@distributed_test
def test_bare_decorator_and_helpers() -> None:
    assert world_size() == 2 and rank() == dist.get_rank()
    expected = torch.device("cuda", dist.get_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")
    assert device() == expected


@pytest.mark.parametrize("scale, expected", [(1, 3.0), (2, 6.0)])
@distributed_test(world_size=2)
def test_decorated_with_parametrize(scale: int, expected: float) -> None:
    t = torch.full((1,), float(scale * (dist.get_rank() + 1)))
    dist.all_reduce(t)
    assert t.item() == expected


@distributed_test(world_size=4)
def test_decorated_four_ranks() -> None:
    out = [torch.zeros(1) for _ in range(4)]
    dist.all_gather(out, torch.full((1,), float(dist.get_rank())))
    assert torch.cat(out).tolist() == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------
# Failure handling (drive the pool directly so the failure is expected)
# ---------------------------------------------------------------------------


def test_rank_exception_reports_traceback_and_restarts_pool() -> None:
    pool = get_pool(2)
    pids_before = pool.pids
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_on, 1)
    message = str(info.value)
    assert "rank 1" in message and "rank 0 -----" not in message
    assert "ValueError: boom from rank 1" in message and "_raise_on" in message
    assert set(info.value.failures) == {1}
    assert pool.run(_raise_on, -1) == [0, 1]  # the next call works...
    assert pool.pids != pids_before  # ...on freshly started workers


def test_peer_stuck_in_collective_is_killed_after_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = get_pool(2)
    monkeypatch.setattr(pool, "grace", 1.0)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_while_peer_in_collective)
    assert time.monotonic() - start < 10
    assert "rank 1 bails out" in str(info.value)
    assert "grace period" in info.value.failures[0]
    assert pool.run(_allreduce_sum) == [3.0, 3.0]


def test_timeout_kills_pool_and_names_silent_rank() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        get_pool(2).run(_sleep_on, 1, 30.0, timeout=3)
    assert time.monotonic() - start < 10
    assert set(info.value.failures) == {1}
    assert "3s timeout" in info.value.failures[1]
    assert run_on_ranks(_sleep_on, 2, 1, 0.0) == [0, 1]


def test_dead_worker_is_reported_with_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        get_pool(2).run(_exit_on, 1, 3)
    assert time.monotonic() - start < 10
    assert "exit code 3" in info.value.failures[1]
    assert run_on_ranks(_exit_on, 2, -1, 0) == [0, 1]


def test_unpicklable_calls_and_results() -> None:
    pool = get_pool(2)
    pids = pool.pids
    with pytest.raises(TypeError, match="module level"):
        pool.run(lambda: None)
    assert pool.pids == pids  # rejected in the parent; pool untouched
    with pytest.raises(RankFailure, match="could not pickle the return value"):
        pool.run(_unpicklable_result)


def test_skip_on_every_rank_skips_the_caller() -> None:
    pool = get_pool(2)
    pids = pool.pids
    with pytest.raises(pytest.skip.Exception, match="not applicable"):
        pool.run(_skip_everywhere)
    assert pool.pids == pids  # a skip is not a failure


def test_decorator_skips_when_ranks_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    @distributed_test(world_size=2, backend="nccl")
    def needs_gpus() -> None:  # never reaches a pool: the skip comes first
        raise AssertionError("unreachable")

    @distributed_test(world_size=3)
    def too_many_cpu_ranks() -> None:
        raise AssertionError("unreachable")

    if torch.cuda.device_count() < 2:
        with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs"):
            needs_gpus()
    monkeypatch.setenv("FSDP_COMPAT_MAX_CPU_RANKS", "2")
    monkeypatch.delenv("FSDP_COMPAT_TEST_BACKEND", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(pytest.skip.Exception, match="exceeds FSDP_COMPAT_MAX_CPU_RANKS=2"):
            too_many_cpu_ranks()


def test_private_pool_context_manager_closes_workers() -> None:
    with RankPool(1, timeout=60) as pool:
        assert pool.run(_whoami, "y") == [(0, 1, "1", "y")]
        procs = list(pool._procs)
    assert pool.closed and all(not p.is_alive() for p in procs)
    assert all(p.exitcode == 0 for p in procs)  # stopped cleanly, not killed
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_whoami, "z")


def _silence_all_warnings() -> None:
    import warnings

    warnings.filterwarnings("ignore")


def _user_warning_is_shown() -> bool:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("shown?", UserWarning)
    return len(caught) == 1


def _moot_option_warnings() -> int:
    import warnings

    import torch.nn as nn

    from fsdp_compat import FullyShardedDataParallel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FullyShardedDataParallel(nn.Linear(4, 4), limit_all_gathers=False)
    return sum("limit_all_gathers" in str(w.message) for w in caught)


def test_warning_filters_a_body_installs_are_gone_in_the_next() -> None:
    run_on_ranks(_silence_all_warnings, 2)
    assert run_on_ranks(_user_warning_is_shown, 2) == [True, True]


def test_once_per_process_warnings_are_given_again_in_the_next_body() -> None:
    assert run_on_ranks(_moot_option_warnings, 2) == [1, 1]
    assert run_on_ranks(_moot_option_warnings, 2) == [1, 1]


def _switch_torch_on() -> None:
    import fsdp_compat

    fsdp_compat.patch_torch()


def _torch_is_switched() -> bool:
    import fsdp_compat

    return fsdp_compat.is_torch_patched()


def test_a_torch_switch_a_body_leaves_on_is_off_in_the_next() -> None:
    run_on_ranks(_switch_torch_on, 2)
    assert run_on_ranks(_torch_is_switched, 2) == [False, False]
