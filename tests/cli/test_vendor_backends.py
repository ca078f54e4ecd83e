"""Ascend (torch_npu) and Cambricon (torch_mlu) backends without their hardware.

Here the vendor runtimes are absent, so the first tests check what a user without them sees. The
rest run in subprocesses with small *fake* torch_npu / torch_mlu packages on PYTHONPATH (written to
a temp dir below): they register a recording ``torch.npu`` / ``torch.mlu`` device module and, for
torch_npu, plain-torch versions of the fused ops written from Ascend's documented semantics
(``npu_fusion_attention`` with BNSD layout, atten_mask True = masked out, scale defaulting to 1.0,
sparse_mode 2 = top-left causal, 3 = bottom-right causal ...). Subprocesses keep the fake
registrations (process-global in torch) away from the rest of the suite.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hal.backends.ascend import AscendBackend
from hal.backends.cambricon import CambriconBackend
from hal.errors import BackendUnavailable

from ..plain_client import run_plain, shared

REPO = Path(__file__).resolve().parents[2]
VENDORS = {"ascend": ("torch_npu", AscendBackend), "cambricon": ("torch_mlu", CambriconBackend)}

# --- the fake vendor packages ------------------------------------------------------------------------
# One device-module template for both: ``DEV`` is npu or mlu, ``PFX`` the env-var prefix.
FAKE_DEVICE_MODULE = '''
"""Fake {pkg} for hal's tests: a recording torch.{dev} module, no device behind it."""
import contextlib
import os
import types

import torch

MODE = os.environ.get("FAKE_{pfx}_MODE", "ok")
if MODE == "broken":
    raise ImportError("libfake_runtime.so: cannot open shared object file: No such file or directory\\nsecond line")

__version__ = "0.0.fake"
CALLS = []  # [name, *args] for every device-module call


def _recording(name, result=None):
    def fn(*args, **kwargs):
        CALLS.append([name, *args])
        return result
    fn.__name__ = name
    return fn


{dev} = types.ModuleType("{pkg}.{dev}")
_state = {{"current": 0}}


def _device_count():
    CALLS.append(["device_count"])
    return int(os.environ.get("FAKE_{pfx}_COUNT", "2"))


def _set_device(index):
    CALLS.append(["set_device", index])
    _state["current"] = index


def _name(index=None):
    return os.environ.get("FAKE_{pfx}_NAME", "{default_name}")


def _properties(index):
    CALLS.append(["get_device_properties", index])
    return types.SimpleNamespace(
        name=_name(index), total_memory=32 * 2**30,
        major=int(os.environ.get("FAKE_{pfx}_MAJOR", "5")), minor=0,
    )


class Stream:
    def __init__(self, device=None, priority=0):
        self.device = device


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing


@contextlib.contextmanager
def _stream(s):
    CALLS.append(["stream", s])
    yield s


{dev}._is_in_bad_fork = lambda: False  # torch.manual_seed asks the device module this
{dev}.device_count = _device_count
{dev}.set_device = _set_device
{dev}.current_device = lambda: _state["current"]
{dev}.get_device_name = _name
{dev}.get_device_properties = _properties
{dev}.synchronize = _recording("synchronize")
{dev}.Stream = Stream
{dev}.Event = Event
{dev}.current_stream = lambda device=None: Stream(device)
{dev}.stream = _stream
{dev}.memory_allocated = _recording("memory_allocated", 111)
{dev}.memory_reserved = _recording("memory_reserved", 222)
{dev}.max_memory_allocated = _recording("max_memory_allocated", 333)
{dev}.reset_peak_memory_stats = _recording("reset_peak_memory_stats")
{dev}.mem_get_info = _recording("mem_get_info", (1000, 2000))
{dev}.empty_cache = _recording("empty_cache")
{dev}.manual_seed = _recording("manual_seed")
{dev}.manual_seed_all = _recording("manual_seed_all")
{dev}.get_rng_state = _recording("get_rng_state", torch.zeros(4, dtype=torch.uint8))
{dev}.set_rng_state = _recording("set_rng_state")

if MODE != "no_module":
    # What the real package does on import: rename PrivateUse1, register {pkg}.{dev} as torch.{dev}.
    torch.utils.rename_privateuse1_backend("{dev}")
    torch._register_device_module("{dev}", {dev})
else:
    del {dev}
'''

FAKE_NPU_EXTRA = '''
# HF32 switches: torch_npu.npu.matmul.allow_hf32 (default False), torch_npu.npu.conv.allow_hf32 (default True).
if MODE != "no_module":
    npu.matmul = types.SimpleNamespace(allow_hf32=False)
    npu.conv = types.SimpleNamespace(allow_hf32=True)

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
OPS = []  # names of the fused ops called


def _require(ok, message):
    if not ok:
        raise RuntimeError("fake torch_npu: " + message)


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """RmsNorm over gamma's (trailing) dims; gamma in self's dtype; returns (y, rstd)."""
    OPS.append("npu_rms_norm")
    _require(self.dtype in FLOATS and gamma.dtype == self.dtype, "gamma must have self's dtype")
    _require(tuple(gamma.shape) == tuple(self.shape[self.dim() - gamma.dim():]), "gamma must match trailing dims")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    xf = self.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(self.dtype), rstd


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """Attention as documented; only the BNSD layout and sparse modes 0-3 are modelled."""
    OPS.append("npu_fusion_attention")
    _require(input_layout == "BNSD", "this fake models input_layout BNSD only")
    _require(query.dtype == key.dtype == value.dtype and query.dtype in FLOATS, "q/k/v dtypes")
    _require(key.shape == value.shape, "key and value must have one shape")
    b, n, s_q, d = query.shape
    n_kv, s_kv = key.shape[1], key.shape[2]
    _require(head_num == n, "head_num must be q's head count")
    _require(n % n_kv == 0, "Nq/Nkv must be an integer")
    _require(pse is None and padding_mask is None and prefix is None and keep_prob == 1.0, "unmodelled args")
    _require(pre_tockens == 2147483647 and next_tockens == 2147483647, "band modes are not modelled")
    kv_head = torch.arange(n) // (n // n_kv)  # q head h reads kv head h // (Nq / Nkv)
    k, v = key[:, kv_head].double(), value[:, kv_head].double()
    scores = (query.double() @ k.transpose(-1, -2)) * scale
    if atten_mask is not None:  # True = this position does not take part
        _require(atten_mask.dtype in (torch.bool, torch.uint8), "atten_mask must be bool/uint8")
        shape = tuple(atten_mask.shape)
        if sparse_mode in (0, 1):
            _require(shape in {{(s_q, s_kv), (1, 1, s_q, s_kv), (b, 1, s_q, s_kv), (b, n, s_q, s_kv)}},
                     f"atten_mask shape {{shape}} is not SS/11SS/B1SS/BNSS")
            _require(atten_mask.is_contiguous(), "atten_mask must be contiguous")
            masked = atten_mask.bool()
        elif sparse_mode in (2, 3):
            expected = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
            _require(shape == (2048, 2048) and torch.equal(atten_mask.bool().cpu(), expected),
                     "sparse_mode 2/3 take the compressed 2048x2048 lower-triangular mask")
            ones = torch.ones(s_q, s_kv, dtype=torch.bool)
            # 2 = leftUpCausal (triangle from the top-left corner), 3 = rightDownCausal (from the bottom-right).
            masked = ones.triu(1) if sparse_mode == 2 else ones.triu(s_kv - s_q + 1)
        else:
            raise RuntimeError(f"fake torch_npu: sparse_mode {{sparse_mode}} is not modelled")
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # a fully masked row gives NaN here
    out = (probs @ v).to(query.dtype)
    return out, probs.amax(-1), probs.sum(-1), torch.empty(0), 0, 0, 0


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """half mode: r1 * input + r2 * cat(-x2, x1); r1/r2 broadcast as documented for BNSD/BSND/SBND."""
    OPS.append("npu_rotary_mul")
    _require(rotary_mode == "half", "only the half mode is modelled")
    _require(input.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape, "4-D input, r1, r2")
    _require(input.dtype == r1.dtype == r2.dtype and input.dtype in FLOATS, "one float dtype")
    a, b, c, d = input.shape
    _require(d % 2 == 0 and d < 896 and r1.shape[-1] == d, "even head dim below 896")
    allowed = {{
        (1, 1, c, d), (a, 1, c, d), (a, b, c, d),  # input BNSD: 11SD, B1SD, BNSD
        (1, b, 1, d), (a, b, 1, d),                # input BSND: 1S1D, BS1D, BSND
        (a, 1, 1, d),                              # input SBND: S11D (SB1D == BS1D shape, SBND == full)
    }}
    _require(tuple(r1.shape) in allowed, f"r1 shape {{tuple(r1.shape)}} is not a documented layout")
    x1, x2 = torch.chunk(input, 2, -1)
    return r1 * input + r2 * torch.cat((-x2, x1), dim=-1)


def npu_swiglu(input, dim=-1):
    """swish(A) * B = A * sigmoid(A) * B for the two halves of input along dim."""
    OPS.append("npu_swiglu")
    _require(input.is_contiguous(), "non-contiguous tensors are not supported")
    _require(input.numel() > 0 and input.shape[dim] % 2 == 0, "dim must split evenly")
    a, b = torch.split(input, input.shape[dim] // 2, dim=dim)
    return a * torch.sigmoid(a) * b


for _name_ in filter(None, os.environ.get("FAKE_NPU_WITHOUT", "").split(",")):
    del globals()[_name_]
'''

FAKE_NPU_GRAPHS = '''
# torch_npu.npu.NPUGraph / torch_npu.npu.graph (torch_npu/npu/graphs.py): recorded, nothing captured.
class NPUGraph:
    def replay(self):
        CALLS.append(["NPUGraph.replay"])


@contextlib.contextmanager
def _graph(npu_graph, pool=None, stream=None, capture_error_mode="global"):
    CALLS.append(["graph", type(npu_graph).__name__, stream])
    yield npu_graph


if MODE != "no_module":
    npu.NPUGraph = NPUGraph
    npu.graph = _graph
'''

# torch_npu.profiler: the Ascend PyTorch Profiler's entry points (a recording stand-in).
FAKE_NPU_PROFILER = '''
import contextlib
import enum

from torch_npu import CALLS


class ProfilerActivity(enum.Enum):
    CPU = 0
    NPU = 1


@contextlib.contextmanager
def profile(activities=None, **kwargs):
    CALLS.append(["profile", sorted(a.name for a in activities), sorted(kwargs)])
    yield None
'''

FAKE_MLU_EXTRA = '''
# torch_mlu installs these on import (torch_mlu/__init__.py): matmul TF32 default False, cnnl TF32 default True.
if MODE != "no_module":
    torch.backends.mlu = types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=False))
    torch.backends.cnnl = types.SimpleNamespace(allow_tf32=True, deterministic=False, benchmark=True)
'''


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding fake torch_npu/ and torch_mlu/ packages."""
    root = tmp_path_factory.mktemp("fake_vendor_runtimes")
    sources = {
        "torch_npu": FAKE_DEVICE_MODULE.format(pkg="torch_npu", dev="npu", pfx="NPU", default_name="Ascend910B2")
        + FAKE_NPU_EXTRA.format() + FAKE_NPU_GRAPHS,
        "torch_mlu": FAKE_DEVICE_MODULE.format(pkg="torch_mlu", dev="mlu", pfx="MLU", default_name="MLU590")
        + FAKE_MLU_EXTRA,
    }
    for package, source in sources.items():
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(source, encoding="utf-8")
    (root / "torch_npu" / "profiler.py").write_text(FAKE_NPU_PROFILER, encoding="utf-8")
    return root


def run_child(code: str, fake_root: Path | None = None, **env: str) -> str:
    """Run ``code`` as ``python -c`` (repo and, if given, the fakes on PYTHONPATH); return stdout.

    The child must print CHILD-OK last: an assertion error or crash anywhere fails the test.
    """
    paths = ([str(fake_root)] if fake_root else []) + [str(REPO)]
    child_env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("HAL_", "FAKE_"))
        and k not in ("ASCEND_RT_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES", "CN_VISIBLE_DEVICES", "HCCL_DETERMINISTIC")
    }
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    child_env.update(env)
    source = textwrap.dedent(code) + "\nprint('CHILD-OK')\n"
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=child_env, cwd=REPO,
                              timeout=300)
    else:  # forked from a server that imported torch only: as a fresh interpreter, without its seconds of imports
        proc = run_plain(shared(), ["-c", source], child_env, REPO, 300)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("CHILD-OK"), proc.stdout + proc.stderr
    return proc.stdout


def _absent(package: str) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here; these tests describe a machine without it")


# --- 1. runtime absent (this machine) -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VENDORS))
def test_absent_runtime_gives_the_specific_not_installed_reason(name: str) -> None:
    package, cls = VENDORS[name]
    _absent(package)
    backend = cls()
    status = backend.availability()
    assert not status.available
    assert status.reason.startswith(f"{package} is not installed (")
    assert ("pip install torch-npu matching torch" in status.reason and "CANN" in status.reason) if name == "ascend" \
        else ("not on PyPI" in status.reason and "CNToolkit" in status.reason)
    assert backend.device_count() == 0
    assert backend.hardware_verification is None and backend.verification == "not verified on hardware"
    assert package not in sys.modules


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_absent_runtime_device_calls_raise_backend_unavailable(name: str) -> None:
    package, cls = VENDORS[name]
    _absent(package)
    backend = cls()
    reason = backend.availability().reason
    calls = {
        "set_device": lambda: backend.set_device(0), "current_device": backend.current_device,
        "device_name": lambda: backend.device_name(0), "synchronize": backend.synchronize,
        "Stream": backend.Stream, "Event": backend.Event, "current_stream": backend.current_stream,
        "memory_allocated": backend.memory_allocated, "max_memory_allocated": backend.max_memory_allocated,
        "reset_peak_memory_stats": backend.reset_peak_memory_stats, "mem_get_info": backend.mem_get_info,
        "empty_cache": backend.empty_cache, "manual_seed": lambda: backend.manual_seed(1),
        "manual_seed_all": lambda: backend.manual_seed_all(1), "get_rng_state": backend.get_rng_state,
        "capabilities": lambda: backend.capabilities(0),
        "set_reduced_precision_matmul": lambda: backend.set_reduced_precision_matmul(True),
    }
    for label, call in calls.items():
        with pytest.raises(BackendUnavailable) as info:
            call()
        assert reason in str(info.value), label
    assert backend.reduced_precision_matmul_enabled() is False
    assert package not in sys.modules


def test_identity_and_process_group_strings() -> None:
    ascend, cambricon = AscendBackend(), CambriconBackend()
    assert (ascend.device_type, ascend.ccl, ascend.visible_devices_env) == ("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")
    assert ascend.reduced_precision_matmul_format == "hf32"
    assert (cambricon.device_type, cambricon.ccl, cambricon.visible_devices_env) == ("mlu", "cncl", "MLU_VISIBLE_DEVICES")
    assert ascend.process_group_backend() == "cpu:gloo,npu:hccl"
    assert cambricon.process_group_backend() == "cpu:gloo,mlu:cncl"


def test_registry_falls_back_to_reference_when_torch_npu_is_absent() -> None:
    _absent("torch_npu")
    from hal.ops import registry

    for op, impl in (("rms_norm", "npu_rms_norm"), ("scaled_dot_product_attention", "npu_fusion_attention"),
                     ("rotary_embedding", "npu_rotary_mul"), ("swiglu", "npu_swiglu")):
        choice = registry.choose(op, "ascend", torch.float16)
        assert choice.impl.name == "reference"
        assert choice.skipped == ((impl, "torch_npu is not installed"),)
        assert registry.choose(op, "ascend", torch.float64).skipped == ()  # the fused ops do not serve fp64
        assert registry.choose(op, "cpu", torch.float16).skipped == ()  # nor other backends
    assert "torch_npu" not in sys.modules


# --- 2. import isolation ------------------------------------------------------------------------------
def test_importing_and_instantiating_does_not_import_vendor_packages(fake_root: Path) -> None:
    """Even with (fake) torch_npu/torch_mlu importable, nothing imports them until a method probes."""
    run_child("""
        import sys
        import hal.backends.ascend, hal.backends.cambricon
        hal.backends.ascend.AscendBackend(); hal.backends.cambricon.CambriconBackend()
        import hal, hal.ops
        hal.all_backends()
        hal.ops.registry.implementations("rms_norm")  # runs every backend's register_ops
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch_npu", "torch_mlu"))
        assert loaded == [], loaded
        assert not hasattr(__import__("torch"), "npu") and not hasattr(__import__("torch"), "mlu")
    """, fake_root)


# --- 3. availability reasons with a fake runtime ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VENDORS))
def test_broken_install_says_it_failed_to_import(name: str, fake_root: Path) -> None:
    package, _ = VENDORS[name]
    pfx = "NPU" if name == "ascend" else "MLU"
    run_child(f"""
        from hal import get_backend
        reason = get_backend("{name}").availability().reason
        missing = "libfake_runtime.so: cannot open shared object file: No such file or directory"
        assert reason == "{package} failed to import: ImportError: " + missing, reason
    """, fake_root, **{f"FAKE_{pfx}_MODE": "broken"})


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_import_without_device_module_says_so(name: str, fake_root: Path) -> None:
    package, _ = VENDORS[name]
    dev = "npu" if name == "ascend" else "mlu"
    run_child(f"""
        from hal import get_backend
        reason = get_backend("{name}").availability().reason
        assert reason.startswith("{package} 0.0.fake imported but torch.{dev} is missing"), reason
    """, fake_root, **{f"FAKE_{dev.upper()}_MODE": "no_module"})


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_runtime_without_devices_says_so(name: str, fake_root: Path) -> None:
    env_var = VENDORS[name][1].visible_devices_env
    pfx = "NPU" if name == "ascend" else "MLU"
    run_child(f"""
        from hal import get_backend
        backend = get_backend("{name}")
        reason = backend.availability().reason
        assert reason == "the {VENDORS[name][1].vendor} runtime loaded but sees no device ({env_var}='')", reason
        assert backend.device_count() == 0
    """, fake_root, **{f"FAKE_{pfx}_COUNT": "0", env_var: ""})


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_fake_runtime_reaches_the_real_device_probe(name: str, fake_root: Path) -> None:
    """The fake imports fine and sees 2 devices, so availability is decided by allocating on device 0,
    which CPU-only torch cannot do: the reason proves the probe ran (and not an import check)."""
    package, _ = VENDORS[name]
    dev = "npu" if name == "ascend" else "mlu"
    run_child(f"""
        import {package}
        from hal import get_backend
        status = get_backend("{name}").availability()
        assert not status.available
        assert status.reason.startswith("device probe on {dev}:0 failed: "), status.reason
        assert ["device_count"] in {package}.CALLS
    """, fake_root)


# --- 3b. backend logic over the fake runtime (device probe bypassed) -------------------------------------
# No NPU/MLU exists here, so the probe above cannot pass. These children set ``_availability`` and
# ``_module`` by hand (bypassing the probe) to test what the backend does with a working runtime.
BYPASS = """
    import os
    import torch
    from hal.backend import Availability
    from hal.capabilities import DtypeSupport, load_catalog
    from hal.errors import BackendUnavailable, UnsupportedError

    def bypassed(cls, dev):
        backend = cls()
        assert not backend.availability().available  # the real probe ran and failed (no device here)
        backend._availability = Availability(True, "fake runtime; device probe bypassed in tests")
        backend._module = getattr(torch, dev)
        return backend

    def catalog_entry(backend_name, model_text):
        if not (Path(__import__("hal").__file__).parent / "catalog" / "devices.yaml").exists():
            return None  # catalog not shipped yet: the one catalog assertion is skipped
        return next((e for e in load_catalog() if backend_name in e.backends and model_text in e.model), None)

    from pathlib import Path
"""


def test_ascend_logic_with_fake_runtime(fake_root: Path) -> None:
    run_child(BYPASS + """
    import torch_npu
    from hal.backends.ascend import AscendBackend
    npu = bypassed(AscendBackend, "npu")
    calls = torch_npu.CALLS

    # HF32: the documented switches torch.npu.matmul.allow_hf32 and torch.npu.conv.allow_hf32.
    assert (torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32) == (False, True)
    assert npu.reduced_precision_matmul_enabled() is False
    npu.set_reduced_precision_matmul(True)
    assert (torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32) == (True, True)
    assert npu.reduced_precision_matmul_enabled() is True
    npu.set_reduced_precision_matmul(False)
    assert (torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32) == (False, False)

    # Delegation to torch.npu.
    assert npu.device_count() == 2
    npu.set_device(1)
    assert calls[-1] == ["set_device", 1] and npu.current_device() == 1
    try:
        npu.set_device(2)
        raise AssertionError("index 2 of 2 devices was accepted")
    except BackendUnavailable as exc:
        assert "out of range" in str(exc)
    npu.manual_seed(3); assert calls[-1] == ["manual_seed", 3]
    npu.manual_seed_all(7); assert calls[-1] == ["manual_seed_all", 7]
    assert npu.memory_allocated(0) == 111 and calls[-1] == ["memory_allocated", 0]
    assert npu.memory_reserved(1) == 222 and npu.max_memory_allocated() == 333
    npu.reset_peak_memory_stats(1); assert calls[-1] == ["reset_peak_memory_stats", 1]
    assert npu.mem_get_info(0) == (1000, 2000) and npu.total_memory(0) == 2000
    npu.empty_cache(); assert calls[-1] == ["empty_cache"]
    npu.synchronize(); assert calls[-1] == ["synchronize", None]
    npu.get_rng_state(); assert calls[-1] == ["get_rng_state", 1]  # the current device
    npu.set_rng_state(torch.zeros(4, dtype=torch.uint8), 0); assert calls[-1][0] == "set_rng_state" and calls[-1][2] == 0
    assert npu.Event(enable_timing=True).enable_timing is True and npu.Stream(1).device == 1
    with npu.stream(npu.current_stream()) as s:
        assert calls[-1] == ["stream", s]
    assert npu.device_name(0) == "Ascend910B2"

    # Capabilities: memory probed; fp64 absent regardless of the catalog.
    caps = npu.capabilities(0)
    assert caps.memory_bytes == 32 * 2**30 and ["get_device_properties", 0] in calls
    assert caps.support("fp64") is DtypeSupport.ABSENT
    entry = catalog_entry("ascend", "910B")
    if entry is not None:
        assert caps.catalog_id == entry.id, (caps.catalog_id, entry.id)
    os.environ["FAKE_NPU_NAME"] = "Ascend-unlisted-9999"  # no catalog entry: fp64 must still be absent
    other = npu.capabilities(0)
    assert other.catalog_id is None and other.support("fp64") is DtypeSupport.ABSENT
    assert other.support("bf16") is DtypeSupport.UNKNOWN

    # Determinism: torch's switch plus HCCL_DETERMINISTIC.
    npu.set_deterministic(True)
    assert torch.are_deterministic_algorithms_enabled() and os.environ["HCCL_DETERMINISTIC"] == "true"
    npu.set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled() and os.environ["HCCL_DETERMINISTIC"] == "false"
    os.environ["HCCL_DETERMINISTIC"] = "strict"
    npu.set_deterministic(True)
    assert os.environ["HCCL_DETERMINISTIC"] == "strict"  # the stricter user setting is kept

    assert npu.process_group_backend() == "cpu:gloo,npu:hccl"
    """, fake_root)


def test_cambricon_logic_with_fake_mlu590(fake_root: Path) -> None:
    run_child(BYPASS + """
    import torch_mlu
    from hal.backends.cambricon import CambriconBackend
    mlu = bypassed(CambriconBackend, "mlu")
    calls = torch_mlu.CALLS

    caps = mlu.capabilities(0)
    assert caps.support("tf32") is DtypeSupport.NATIVE and caps.extra["device_major"] == 5
    entry = catalog_entry("cambricon", "MLU590")
    if entry is not None:
        assert caps.catalog_id == entry.id, (caps.catalog_id, entry.id)

    # TF32: torch.backends.mlu.matmul.allow_tf32 and torch.backends.cnnl.allow_tf32.
    assert mlu.reduced_precision_matmul_enabled() is False
    mlu.set_reduced_precision_matmul(True)
    assert torch.backends.mlu.matmul.allow_tf32 is True and torch.backends.cnnl.allow_tf32 is True
    assert mlu.reduced_precision_matmul_enabled() is True
    mlu.set_reduced_precision_matmul(False)
    assert torch.backends.mlu.matmul.allow_tf32 is False and torch.backends.cnnl.allow_tf32 is False

    mlu.set_device(1); assert calls[-1] == ["set_device", 1]
    mlu.manual_seed_all(5); assert calls[-1] == ["manual_seed_all", 5]
    assert mlu.max_memory_allocated(1) == 333 and calls[-1] == ["max_memory_allocated", 1]

    mlu.set_deterministic(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cnnl.deterministic is True and torch.backends.cnnl.benchmark is False
    mlu.set_deterministic(False)
    assert torch.backends.cnnl.deterministic is False
    assert mlu.process_group_backend() == "cpu:gloo,mlu:cncl"
    """, fake_root)


def test_contract_answers_over_the_fake_runtimes(fake_root: Path) -> None:
    """What each vendor backend answers for graphs, the host cache and the profiler is read off the runtime it
    loaded: the fake torch_npu has NPUGraph and torch_npu.profiler but no host_memory_stats; the fake torch_mlu
    has no MLUGraph, and its profiler activity is torch's PrivateUse1 under the name the package renames it to."""
    run_child(BYPASS + """
    import torch_npu
    from hal.backend import CONTRACT_ITEMS
    from hal.backends.ascend import AscendBackend
    npu = bypassed(AscendBackend, "npu")
    calls = torch_npu.CALLS
    answers = npu.contract()
    assert tuple(answers) == CONTRACT_ITEMS, answers
    assert answers["graph_capture"].state == "supported", answers
    assert answers["graph_capture"].api == "torch.npu.NPUGraph / torch.npu.graph", answers
    graph = npu.Graph()
    with npu.graph(graph, stream="s1"):
        pass
    assert type(graph).__name__ == "NPUGraph" and calls[-1] == ["graph", "NPUGraph", "s1"], calls[-3:]
    assert answers["profiler"].state == "supported", answers
    with npu.profiler(record_shapes=True):
        pass
    assert calls[-1] == ["profile", ["CPU", "NPU"], ["record_shapes"]], calls[-3:]
    assert answers["host_cache"].state == "unsupported", answers
    assert "host_memory_stats" in answers["host_cache"].reason, answers
    for call in (npu.host_memory_stats, npu.empty_host_cache):
        try:
            call()
            raise AssertionError(f"{call.__name__} without host_memory_stats was served")
        except UnsupportedError as exc:
            assert "cannot serve host cache" in str(exc) and "no host_memory_stats" in str(exc), str(exc)
    """, fake_root)
    # a second child: one process renames PrivateUse1 once
    run_child(BYPASS + """
    from hal.backends.cambricon import CambriconBackend
    mlu = bypassed(CambriconBackend, "mlu")
    answers = mlu.contract()
    assert answers["graph_capture"].state == "unsupported", answers
    assert "torch.mlu.MLUGraph" in answers["graph_capture"].reason, answers
    try:
        mlu.Graph()
        raise AssertionError("a graph without MLUGraph was made")
    except UnsupportedError as exc:
        assert "graph capture" in str(exc), str(exc)
    # renaming PrivateUse1 to "mlu" (what torch_mlu does on import) gives torch.profiler a ProfilerActivity.MLU
    assert answers["profiler"].state == "supported", answers
    assert answers["rng"].state == "supported" and answers["rng"].api == "torch.mlu.get_rng_state / set_rng_state", answers
    """, fake_root)


def test_cambricon_mlu370_has_no_tf32(fake_root: Path) -> None:
    run_child(BYPASS + """
    from hal.backends.cambricon import CambriconBackend
    mlu = bypassed(CambriconBackend, "mlu")
    caps = mlu.capabilities(0)
    assert caps.support("tf32") is DtypeSupport.ABSENT
    entry = catalog_entry("cambricon", "MLU370-X8")
    if entry is not None:
        assert caps.catalog_id == entry.id, (caps.catalog_id, entry.id)
    try:
        mlu.set_reduced_precision_matmul(True)
        raise AssertionError("TF32 was enabled on an MLU370")
    except UnsupportedError as exc:
        assert "MLU370-X8 has no TF32" in str(exc) and "use precision fp32" in str(exc), exc
    assert torch.backends.mlu.matmul.allow_tf32 is False
    mlu.set_reduced_precision_matmul(False)  # turning it off is always fine
    """, fake_root, FAKE_MLU_NAME="MLU370-X8", FAKE_MLU_MAJOR="3")


# --- 4. fused-op wrappers against the reference ------------------------------------------------------
OPS_PRELUDE = """
    import torch
    import torch_npu
    from torch.testing import assert_close
    from hal.downgrades import clear_downgrades, fallback_policy, recorded_downgrades
    from hal.errors import FallbackRefused
    from hal.ops import registry

    IMPLS = {
        op: {impl.name: impl.fn for impl in registry.implementations(op)}
        for op in ("rms_norm", "scaled_dot_product_attention", "rotary_embedding", "swiglu")
    }
    torch.manual_seed(0)

    def check(op, impl, *args, **kwargs):
        # The registered wrapper must call the vendor op (no downgrade allowed) and match the reference.
        before = len(torch_npu.OPS)
        with fallback_policy("error"):
            got = IMPLS[op][impl](*args, **kwargs)
        assert torch_npu.OPS[before:] == [impl], (op, torch_npu.OPS[before:])
        want = IMPLS[op]["reference"](*args, **kwargs)
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
        loose = want.dtype in (torch.float16, torch.bfloat16)
        assert_close(got, want, **({"rtol": 2e-2, "atol": 2e-2} if loose else {}))
"""


def test_ascend_fused_ops_match_the_reference(fake_root: Path) -> None:
    run_child(OPS_PRELUDE + """
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(2, 3, 16).to(dtype)
        check("rms_norm", "npu_rms_norm", x, torch.randn(16).to(dtype))
        check("rms_norm", "npu_rms_norm", x, torch.randn(16).to(dtype), eps=1e-2)

    def qkv(b, n_q, n_kv, s_q, s_kv, d, dtype=torch.float32):
        return (torch.randn(b, n_q, s_q, d, dtype=dtype), torch.randn(b, n_kv, s_kv, d, dtype=dtype),
                torch.randn(b, n_kv, s_kv, d, dtype=dtype))

    def keep_mask(*shape):
        mask = torch.rand(*shape) > 0.4
        mask[..., 0] = True  # every query row keeps at least one key
        return mask

    sdpa = "scaled_dot_product_attention"
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 4, 6, 6, 8))  # default scale 1/sqrt(8)
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 4, 6, 6, 8), scale=0.3)
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 4, 6, 6, 8), is_causal=True)
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 4, 5, 9, 8), is_causal=True)  # top-left, not bottom-right
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 4, 9, 5, 8), is_causal=True)
    check(sdpa, "npu_fusion_attention", *qkv(2, 8, 2, 6, 6, 16), is_causal=True)  # GQA 8 q heads on 2 kv heads
    check(sdpa, "npu_fusion_attention", *qkv(1, 6, 3, 4, 7, 16), scale=0.5)  # GQA, no mask
    for shape in [(1, 7), (5, 7), (2, 1, 1, 7), (2, 1, 5, 7), (1, 4, 5, 7), (2, 4, 5, 7), (1, 1, 5, 7), (4, 5, 7)]:
        check(sdpa, "npu_fusion_attention", *qkv(2, 4, 4, 5, 7, 8), attn_mask=keep_mask(*shape))
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 2, 5, 7, 8), attn_mask=keep_mask(2, 4, 5, 7))  # GQA + mask
    dead = keep_mask(2, 1, 5, 7)
    dead[1, 0, 2] = False  # a query row with every key masked: torch gives 0 there
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 4, 5, 7, 8), attn_mask=dead)
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 2, 6, 6, 16, torch.float16), is_causal=True)
    check(sdpa, "npu_fusion_attention", *qkv(2, 4, 4, 6, 6, 16, torch.bfloat16), attn_mask=keep_mask(6, 6))

    def cos_sin(shape, dtype=torch.float32):
        angles = torch.rand(*shape) * 6.28
        return angles.cos().to(dtype), angles.sin().to(dtype)

    rope = "rotary_embedding"
    check(rope, "npu_rotary_mul", torch.randn(2, 4, 6, 8), *cos_sin((1, 1, 6, 8)))  # BNSD, 11SD
    check(rope, "npu_rotary_mul", torch.randn(2, 4, 6, 8), *cos_sin((2, 1, 6, 8)))  # B1SD
    check(rope, "npu_rotary_mul", torch.randn(2, 6, 4, 8), *cos_sin((1, 6, 1, 8)))  # BSND, 1S1D
    check(rope, "npu_rotary_mul", torch.randn(6, 2, 4, 8), *cos_sin((6, 1, 1, 8)))  # SBND, S11D
    check(rope, "npu_rotary_mul", torch.randn(2, 4, 6, 8), *cos_sin((2, 4, 6, 8)))  # full
    check(rope, "npu_rotary_mul", torch.randn(2, 4, 6, 64).half(), *cos_sin((1, 1, 6, 64), torch.float16))
    check(rope, "npu_rotary_mul", torch.randn(2, 4, 6, 8), *cos_sin((6, 8)))  # hal's (S, D) tables, as 11SD
    check(rope, "npu_rotary_mul", torch.randn(2, 4, 6, 8), *cos_sin((1, 6, 8)))  # 3-D, as 11SD

    check("swiglu", "npu_swiglu", torch.randn(4, 10))
    check("swiglu", "npu_swiglu", torch.randn(6, 3), dim=0)
    check("swiglu", "npu_swiglu", torch.randn(10, 4).t())  # non-contiguous input is made contiguous
    check("swiglu", "npu_swiglu", torch.randn(2, 3, 8).bfloat16(), dim=-1)
    """, fake_root)


def test_ascend_inexpressible_calls_run_the_reference_and_say_so(fake_root: Path) -> None:
    run_child(OPS_PRELUDE + """
    def downgraded(op, impl, *args, **kwargs):
        # Runs the reference (exactly), records the downgrade, never calls the vendor op; refused under 'error'.
        clear_downgrades()
        before = len(torch_npu.OPS)
        with fallback_policy("allow"):
            got = IMPLS[op][impl](*args, **kwargs)
        assert torch_npu.OPS[before:] == [], (op, torch_npu.OPS[before:])
        assert torch.equal(got, IMPLS[op]["reference"](*args, **kwargs))
        [record] = recorded_downgrades()
        assert (record.kind, record.requested, record.used) == ("op", impl, "reference"), record
        assert record.subject.startswith(op + " on ascend/") and record.reason, record
        with fallback_policy("error"):
            try:
                IMPLS[op][impl](*args, **kwargs)
                raise AssertionError("a downgrade went through under fallback: error")
            except FallbackRefused:
                pass
        return record.reason

    x = torch.randn(2, 3, 16).half()
    assert "weight in the input's dtype" in downgraded("rms_norm", "npu_rms_norm", x, torch.randn(16))
    assert "1-D weight" in downgraded("rms_norm", "npu_rms_norm", x, torch.randn(3, 16).half())

    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    additive = torch.randn(5, 7)
    assert "additive" in downgraded("scaled_dot_product_attention", "npu_fusion_attention", q, k, v, attn_mask=additive)
    keep = torch.ones(5, 7, dtype=torch.bool)
    assert "is_causal" in downgraded("scaled_dot_product_attention", "npu_fusion_attention", q, k, v, keep, True)
    assert "4-D" in downgraded("scaled_dot_product_attention", "npu_fusion_attention", q[0], k[0], v[0])

    x = torch.randn(2, 4, 6, 8)
    cos, sin = torch.rand(1, 1, 1, 8), torch.rand(1, 1, 1, 8)
    assert "broadcast layout" in downgraded("rotary_embedding", "npu_rotary_mul", x, cos, sin)
    cos, sin = torch.rand(1, 1, 6, 8), torch.rand(1, 1, 6, 8)
    assert "one dtype" in downgraded("rotary_embedding", "npu_rotary_mul", x.half(), cos, sin)

    assert "even size" in downgraded("swiglu", "npu_swiglu", torch.randn(4, 3))  # halves of 2 and 1 broadcast
    """, fake_root)


def test_registry_picks_the_fused_ops_when_torch_npu_is_present(fake_root: Path) -> None:
    run_child("""
        import torch
        from hal.ops import registry
        pairs = (("rms_norm", "npu_rms_norm"), ("scaled_dot_product_attention", "npu_fusion_attention"),
                 ("rotary_embedding", "npu_rotary_mul"), ("swiglu", "npu_swiglu"))
        for op, impl in pairs:
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                choice = registry.choose(op, "ascend", dtype)
                assert (choice.impl.name, choice.skipped) == (impl, ()), (op, dtype, choice)
                assert "hiascend.com" in choice.impl.source or "Ascend/op-plugin" in choice.impl.source
            assert registry.choose(op, "ascend", torch.float64).impl.name == "reference"
            assert registry.choose(op, "cuda", torch.float16).impl.name == "reference"
    """, fake_root)


def test_registry_skips_an_op_this_torch_npu_lacks(fake_root: Path) -> None:
    run_child("""
        import torch
        from hal.ops import registry
        choice = registry.choose("swiglu", "ascend", torch.bfloat16)
        assert choice.impl.name == "reference", choice
        [(name, why)] = choice.skipped
        assert name == "npu_swiglu" and "has no npu_swiglu" in why, why
        assert registry.choose("rms_norm", "ascend", torch.bfloat16).impl.name == "npu_rms_norm"
    """, fake_root, FAKE_NPU_WITHOUT="npu_swiglu")
