"""Regional compilation of a stage: every decoder layer through ``torch.compile`` (``compile: true``).

Each layer is compiled on its own (as torchtitan does; an MoE layer's host reads and exchanges eager inside it, ``compile_layers``): the
layers share one code object, so the
compiler traces one layer and reuses it for the rest, and the stage's embedding, head, loss and the
engine's communication stay eager. hal's ops dispatch through a per-op cache keyed by device and
dtype; a miss inside a traced region is a graph break, so the stage's first forward runs eagerly
(``torch.compiler.set_stance("force_eager")``), filling the caches with exactly the dtypes the run
uses, and compilation starts with the second, with no graph break (tests/unit/test_compile_stage.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from hal.downgrades import Downgrade, record_downgrade
from hal.errors import UnsupportedError
from hal.parallel.models.graph_breaks import before_compiling
from hal.parallel.models.moe import MoE, experts_outside_the_graph
from hal.parallel.models.stage import Stage


def compile_layers(stage: Stage, backend: str, dynamic: bool | None = None) -> None:
    """Compile each decoder layer of ``stage`` in place (``nn.Module.compile``; ``dynamic`` as torch.compile's:
    ``hal profile`` passes False, so each row count it times gets the static graph a run of that shape gets).

    An MoE layer is compiled whole. Its experts run in the graph where the grouped matmul takes them (CUDA:
    offsets on the device, static shapes, no host read); what reads the host or talks to other ranks — the
    experts' loop on other devices, the expert-parallel exchange, the balance all-reduce — runs eagerly between
    the layer's graphs (a graph break, not a recompile). Where the experts will not be in the graph, that is
    recorded as a downgrade."""
    if not hasattr(torch.nn.Module, "compile"):
        raise UnsupportedError(f"torch {torch.__version__} has no nn.Module.compile; use torch >= 2.2 or compile: false")
    before_compiling()  # the eager islands inside a layer are marked for Dynamo now, not at import
    breaks: dict[int, str] = {}
    for index, layer in stage.layers.items():
        layer.compile(backend=backend, dynamic=dynamic)
        if isinstance(getattr(layer, "mlp", None), MoE):
            block = layer.mlp
            block.compiled = True
            why = experts_outside_the_graph(block.ep_group.size if block.ep_group is not None else 1,
                                            block.experts.gate_up.device.type, block.grouped)
            if why:
                breaks[int(index)] = why
    for why in sorted(set(breaks.values())):
        layers = sorted(i for i, w in breaks.items() if w == why)
        record_downgrade(Downgrade("op", f"compile of MoE layers {layers}", "the experts inside the compiled layer",
                                   "the layers compiled, the experts eager between their graphs", why))


@contextlib.contextmanager
def eager_first_forward() -> Iterator[None]:
    """Run the enclosed forward eagerly (it fills hal's op caches for the dtypes in use)."""
    set_stance: Any = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # torch < 2.6: the first compiled call resolves the caches itself (graph breaks)
        yield
        return
    with set_stance("force_eager"):
        yield
