"""The contract suite: on the CPU backend every item it answers "supported" passes and the two it cannot
serve (pinned host cache, graph capture) are "unsupported" with their reasons; planted faults — subclasses of
the real CPU backend that get one item wrong, or claim an item they cannot serve — fail it."""
from __future__ import annotations

from typing import Any

import torch

from hal.backend import CONTRACT_ITEMS
from hal.backends.cpu import CpuBackend
from hal.conformance.cases import Context, Outcome
from hal.conformance.suites import contract


def _run(backend: CpuBackend) -> dict[str, Outcome]:
    ctx = Context(backend, backend.device(0), backend.capabilities(0))
    return {case.name: case.run(ctx) for case in contract.cases(ctx)}


def test_the_cpu_backend_passes_what_it_supports_and_says_why_not_for_the_rest() -> None:
    outcomes = _run(CpuBackend())
    assert tuple(outcomes) == CONTRACT_ITEMS
    unsupported = {name for name, o in outcomes.items() if o.status == "unsupported"}
    assert unsupported == {"host_cache", "graph_capture"}
    assert "the host is the memory" in outcomes["host_cache"].reason
    assert "no graph capture on the host" in outcomes["graph_capture"].reason
    for name in set(outcomes) - unsupported:
        assert outcomes[name].status == "pass", (name, outcomes[name].reason)
    assert outcomes["memory_stats"].metrics["grew_mib"] >= 0.9 * 96


class StateIgnoringRng(CpuBackend):
    """Planted fault: set_rng_state accepts the state and does nothing with it."""

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        pass


class FrozenPeak(CpuBackend):
    """Planted fault: the peak never moves (a vendor module whose reset does nothing and whose peak is stale)."""

    def max_memory_allocated(self, index: int | None = None) -> int:
        return 1

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        pass


class SilentProfiler(CpuBackend):
    """Planted fault: the profiler hook never records (its schedule waits for a step nobody takes)."""

    def profiler(self, **kwargs: Any) -> Any:
        from torch.profiler import ProfilerActivity, profile, schedule

        return profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=0, active=1), **kwargs)


class ClaimsGraphs(CpuBackend):
    """Planted fault: answers "supported" for graph capture, and its graph replays nothing."""

    class _Graph:
        def replay(self) -> None:
            pass

    def _contract_answers(self) -> dict[str, tuple[bool, str, str]]:
        return {**super()._contract_answers(), "graph_capture": (True, "a graph that does nothing", "")}

    def Graph(self) -> Any:  # noqa: N802
        return self._Graph()

    def graph(self, graph: Any, stream: Any = None) -> Any:
        import contextlib

        return contextlib.nullcontext(graph)


def test_planted_faults_fail_their_item_and_only_it() -> None:
    for backend, item in ((StateIgnoringRng(), "rng"), (FrozenPeak(), "memory_stats"), (SilentProfiler(), "profiler"),
                          (ClaimsGraphs(), "graph_capture")):
        outcomes = _run(backend)
        failed = {name for name, o in outcomes.items() if o.failed}
        assert failed == {item}, (type(backend).__name__, {n: (o.status, o.reason) for n, o in outcomes.items()})
