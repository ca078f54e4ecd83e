"""ONNX backend node tests as golden data: single-node models with their inputs and expected outputs.

The installed ``onnx`` package is the source (an optional extra: ``pip install hetero-hal[onnx]``).
Where it ships stored test data (``onnx/backend/test/data/node/<test>/model.onnx`` with
``test_data_set_0/input_*.pb`` and ``output_*.pb``) that data is read; otherwise (onnx 1.23 wheels
ship none) the same tests are generated from ``onnx.backend.test.case.node`` — the code the ONNX
project runs to write those files. ``_expanded`` variants (the op decomposed into other ONNX ops) are
left out: they test an ONNX function body, not the op.
"""
from __future__ import annotations

import contextlib
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

INSTALL_HINT = "pip install hetero-hal[onnx]"

# ONNX op type -> module of onnx.backend.test.case.node that generates its tests
CASE_MODULES: dict[str, str] = {
    "Softmax": "softmax",
    "LayerNormalization": "layernormalization",
    "RMSNormalization": "rmsnormalization",
    "Gelu": "gelu",
    "Swish": "swish",
    "SwiGLU": "swiglu",
    "MatMul": "matmul",
    "Gemm": "gemm",
    "Gather": "gather",
    "SoftmaxCrossEntropyLoss": "softmax_cross_entropy_loss",
    "RotaryEmbedding": "rotaryembedding",
    "Attention": "attention",
}


@dataclass(frozen=True)
class NodeTest:
    """One ONNX node test: the node's type, attributes and inputs, and the golden outputs."""

    name: str
    op_type: str
    opset: int
    attrs: dict[str, Any]
    input_names: tuple[str, ...]  # the node's inputs in order; "" marks an omitted optional input
    inputs: tuple[np.ndarray | None, ...]  # aligned with input_names (None where omitted)
    outputs: tuple[np.ndarray, ...]
    source: str  # "stored" (the onnx package's .pb files) or "generated" (onnx.backend.test.case)


def onnx_version() -> str | None:
    """The installed onnx's version, or None when it is absent (the suite is then unsupported)."""
    try:
        import onnx
    except ImportError:
        return None
    return str(onnx.__version__)


def stored_data_dir() -> Path:
    import onnx

    return Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "node"


def load_tests(op_types: tuple[str, ...]) -> tuple[dict[str, list[NodeTest]], dict[str, str]]:
    """Node tests per op type, and a reason per op type the installed onnx has no tests for."""
    found: dict[str, list[NodeTest]] = {op: [] for op in op_types}
    stored = stored_data_dir()
    if stored.is_dir():
        for test in load_stored(stored, op_types):
            found[test.op_type].append(test)
    missing: dict[str, str] = {}
    for op in op_types:
        if found[op]:
            continue
        try:
            found[op] = generate(op)
        except ModuleNotFoundError:
            missing[op] = f"onnx {onnx_version()} has no node tests for {op}"
        if not found[op] and op not in missing:
            missing[op] = f"onnx {onnx_version()} generated no single-node tests for {op}"
    return found, missing


# --- stored .pb data ---------------------------------------------------------------------------------


def _numbered(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: int(re.findall(r"\d+", p.stem)[-1]))


def load_stored(root: Path, op_types: tuple[str, ...] | None = None) -> list[NodeTest]:
    """Single-node tests under ``root`` (``<test>/model.onnx`` + ``test_data_set_0/*.pb``) of ``op_types``
    (None: every op type), sorted by name. Data files are read only for the op types asked for."""
    import onnx
    from onnx import numpy_helper

    tests: list[NodeTest] = []
    for model_path in sorted(root.glob("*/model.onnx")):
        name = model_path.parent.name
        data = model_path.parent / "test_data_set_0"
        if name.endswith("_expanded") or "_expanded_" in name or not data.is_dir():
            continue
        model = onnx.load(str(model_path))
        if len(model.graph.node) != 1 or (op_types is not None and model.graph.node[0].op_type not in op_types):
            continue

        def read(path: Path) -> np.ndarray:
            tensor = onnx.TensorProto()
            tensor.ParseFromString(path.read_bytes())
            return numpy_helper.to_array(tensor)

        arrays = [read(p) for p in _numbered(list(data.glob("input_*.pb")))]
        outputs = tuple(read(p) for p in _numbered(list(data.glob("output_*.pb"))))
        tests.append(_node_test(name, model, arrays, outputs, "stored"))
    return tests


# --- generated from onnx.backend.test.case -------------------------------------------------------------


@contextlib.contextmanager
def _all_op_types(node_module: Any) -> Iterator[None]:
    """onnx's ``collect_testcases(op)`` leaves a module-level filter set; clear it while we import."""
    saved = getattr(node_module, "_TargetOpType", None)
    node_module._TargetOpType = None
    try:
        yield
    finally:
        node_module._TargetOpType = saved


def generate(op_type: str) -> list[NodeTest]:
    """``op_type``'s node tests as ``onnx.backend.test.case.node`` generates them (numpy, no files)."""
    import warnings

    import onnx.backend.test.case.node as node_cases

    module_name = f"{node_cases.__name__}.{CASE_MODULES[op_type]}"
    with _all_op_types(node_cases), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators' own numpy overflow warnings
        if module_name in sys.modules and not _matching(node_cases, op_type):
            importlib.reload(sys.modules[module_name])  # imported earlier under another op filter
        else:
            importlib.import_module(module_name)
    tests: dict[str, NodeTest] = {}
    for case in _matching(node_cases, op_type):
        if case.name in tests:
            continue
        inputs, outputs = case.data_sets[0]
        tests[case.name] = _node_test(case.name, case.model, list(inputs), tuple(outputs), "generated")
    return list(tests.values())


def _matching(node_cases: Any, op_type: str) -> list[Any]:
    out = []
    for case in node_cases._NodeTestCases:
        if case.name.endswith("_expanded") or "_expanded_" in case.name or case.model is None:
            continue
        nodes = case.model.graph.node
        if len(nodes) == 1 and nodes[0].op_type == op_type and case.data_sets:
            out.append(case)
    return out


def _node_test(name: str, model: Any, arrays: list[np.ndarray], outputs: tuple[np.ndarray, ...], source: str) -> NodeTest:
    """Align the data (given for the non-empty node inputs, in order) with the node's input slots."""
    from onnx import helper

    node = model.graph.node[0]
    attrs = {a.name: _attr(helper.get_attribute_value(a)) for a in node.attribute}
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    values: list[np.ndarray | None] = []
    remaining = iter(arrays)
    for slot in node.input:
        values.append(next(remaining, None) if slot else None)
    return NodeTest(name, node.op_type, int(opset), attrs, tuple(node.input), tuple(values), outputs, source)


def _attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    return value
