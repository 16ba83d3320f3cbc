"""Unit tests for the cost_models package: catalog, roofline, comm, calibration."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cost_models as cm
from cost_models import (
    Calibration,
    DeviceCategory,
    DeviceSpec,
    LinkSpec,
    OpKind,
    OpSample,
    UnknownDeviceKind,
)

GPU_KINDS = [k for k in cm.known_kinds() if k != "cpu"]
FAST = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------- catalog

def test_catalog_has_the_required_entries() -> None:
    for kind in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "L4",
                 "T4", "RTX-4090"):
        assert kind in cm.known_kinds()
    for name in ("nvlink2", "nvlink3", "nvlink4", "pcie3", "pcie4", "pcie5", "eth100",
                 "ib-hdr", "ib-ndr", "gloo-loopback"):
        assert cm.get_link(name).name == name


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_entries_are_sane(kind: str) -> None:
    spec = cm.get_device(kind)
    assert spec.category is DeviceCategory.GPU and not spec.measured
    assert 8 * 2**30 <= spec.memory_bytes <= 200 * 2**30
    assert 1e11 < spec.mem_bw < 1e13
    assert all(0 < rate < 1e16 for rate in spec.peak_flops.values())
    assert set(spec.peak_flops) <= set(cm.DTYPES)
    assert "NVIDIA" in spec.source
    cm.get_link(spec.host_link)  # resolvable
    if spec.peer_link is not None:
        assert spec.peer_link.startswith("nvlink")


def test_memory_sizes_and_float32_is_not_tf32() -> None:
    assert abs(cm.get_device("A100-80GB").memory_bytes / 2**30 - 80) < 2
    assert abs(cm.get_device("A100-40GB").memory_bytes / 2**30 - 40) < 2
    a100 = cm.get_device("A100-80GB")
    assert a100.peak_flops["float32"] == pytest.approx(19.5e12)  # plain FP32, not 156 TF32
    assert "bfloat16" not in cm.get_device("V100-32GB").peak_flops
    assert "float8" not in a100.peak_flops


@pytest.mark.parametrize("a100", ["A100-40GB", "A100-80GB"])
def test_h100_beats_a100_on_every_shared_dtype(a100: str) -> None:
    h100, a = cm.get_device("H100-80GB"), cm.get_device(a100)
    shared = set(h100.peak_flops) & set(a.peak_flops)
    assert {"float32", "bfloat16", "float16", "tf32"} <= shared
    for dtype in shared:
        assert h100.peak_flops[dtype] > a.peak_flops[dtype], dtype
    assert h100.mem_bw > a.mem_bw


def test_links_are_positive_and_ordered() -> None:
    links = [cm.get_link(name) for name in cm.known_links()]
    assert all(link.gbps > 0 and link.latency_us >= 0 and link.source for link in links)
    gbps = {link.name: link.gbps for link in links}
    assert gbps["nvlink2"] < gbps["nvlink3"] < gbps["nvlink4"]
    assert gbps["pcie3"] < gbps["pcie4"] < gbps["pcie5"]
    assert gbps["eth100"] < gbps["ib-hdr"] < gbps["ib-ndr"]


def test_unknown_kind_error_names_kind_and_lists_known_ones() -> None:
    with pytest.raises(UnknownDeviceKind) as info:
        cm.get_device("B300-2TB")
    assert isinstance(info.value, LookupError)
    message = str(info.value)
    assert "B300-2TB" in message
    assert all(kind in message for kind in cm.known_kinds())
    with pytest.raises(LookupError, match="nvlink9"):
        cm.get_link("nvlink9")
    with pytest.raises(UnknownDeviceKind):
        cm.default_link("A100-80GB", "nope", same_host=True)


def test_default_link() -> None:
    assert cm.default_link("A100-80GB", "A100-80GB", same_host=True).name == "nvlink3"
    assert cm.default_link("H100-80GB", "H100-80GB", same_host=True).name == "nvlink4"
    assert cm.default_link("A100-80GB", "A100-80GB", same_host=False).name == "eth100"
    assert cm.default_link("cpu", "cpu", same_host=True).name == "gloo-loopback"
    assert cm.default_link("cpu", "cpu", same_host=False).name == "eth100"
    assert cm.default_link("A100-80GB", "cpu", same_host=True).name == "pcie4"
    assert cm.default_link("cpu", "H100-80GB", same_host=True).name == "pcie5"
    assert cm.default_link("L4", "L4", same_host=True).name == "pcie4"  # no NVLink
    assert cm.default_link("T4", "A100-80GB", same_host=True).name == "pcie3"  # slower end


@pytest.mark.parametrize("name,gib,kind", [
    ("NVIDIA H100 80GB HBM3", 79.2, "H100-80GB"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB"),
    ("Tesla V100-SXM2-32GB", 31.7, "V100-32GB"),
    ("Tesla T4", 14.7, "T4"),
    ("NVIDIA GeForce RTX 4090", 23.6, "RTX-4090"),
    ("NVIDIA L4", 22.0, "L4"),
    ("NVIDIA H200", 139.8, "H200-141GB"),
    ("NVIDIA L40S", 44.4, None),
    ("NVIDIA H100 PCIe", 79.2, None),
    ("Tesla V100-SXM2-16GB", 15.8, None),
    ("NVIDIA GeForce RTX 4090 D", 23.6, None),
    ("", 1.0, None),
])
def test_kind_from_cuda_name(name: str, gib: float, kind: str | None) -> None:
    assert cm.kind_from_cuda_name(name, int(gib * 2**30)) == kind


def test_device_spec_validates_and_is_immutable() -> None:
    with pytest.raises(ValueError, match="memory_bytes"):
        DeviceSpec("x", "gpu", 0, 1e9, {"float32": 1e12}, 0.0, "pcie4", None)
    with pytest.raises(ValueError, match="int4"):
        DeviceSpec("x", "gpu", 1, 1e9, {"float32": 1e12, "int4": 1e12}, 0.0, "pcie4", None)
    spec = cm.get_device("T4")
    with pytest.raises(TypeError):
        spec.peak_flops["float32"] = 1.0  # type: ignore[index]
    assert hash(spec) == hash(cm.get_device("t4"))


def test_host_cpu_is_measured_positive_and_cached() -> None:
    cpu = cm.host_cpu()
    assert cpu is cm.host_cpu() is cm.get_device("cpu")
    assert cpu.category is DeviceCategory.CPU and cpu.measured
    assert cpu.memory_bytes > 2**28 and cpu.mem_bw > 1e8
    assert cpu.peak_flops["float32"] > 1e8 and cpu.launch_overhead_ms > 0
    assert cpu.peak_flops["float64"] < cpu.peak_flops["float32"]


@pytest.mark.dist
def test_import_does_not_pull_in_hpml_compile_or_torch() -> None:
    code = ("import sys, cost_models; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('hpml_compile', 'torch')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- roofline

ROOF_KINDS = [k for k in OpKind if k is not OpKind.VIEW]
sizes = st.floats(min_value=0, max_value=1e15, allow_nan=False)


@FAST
@given(kind=st.sampled_from(ROOF_KINDS), device=st.sampled_from(GPU_KINDS),
       dtype=st.sampled_from(cm.DTYPES), flops=sizes, nbytes=sizes,
       more=st.floats(min_value=0, max_value=1e15))
def test_roofline_is_monotone(kind: OpKind, device: str, dtype: str, flops: float,
                              nbytes: float, more: float) -> None:
    spec = cm.get_device(device)
    base = cm.op_time_ms(kind, flops, nbytes, spec, dtype)
    assert base >= spec.launch_overhead_ms
    assert cm.op_time_ms(kind, flops + more, nbytes, spec, dtype) >= base
    assert cm.op_time_ms(kind, flops, nbytes + more, spec, dtype) >= base


@pytest.mark.parametrize("device", GPU_KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_roofline_sides_of_the_ridge(device: str, dtype: str) -> None:
    spec = cm.get_device(device)
    eff = cm.prior_efficiency(spec.category)
    ridge = cm.ridge_point(spec, dtype)
    nbytes = 1e9

    def compute_ms(flops: float) -> float:
        return flops / (cm.peak_rate(spec, dtype) * eff.compute) * 1e3

    memory_ms = nbytes / (spec.mem_bw * eff.memory) * 1e3
    above = cm.op_time_ms("matmul", 10 * ridge * nbytes, nbytes, spec, dtype)
    below = cm.op_time_ms("matmul", 0.1 * ridge * nbytes, nbytes, spec, dtype)
    # a GPU op takes the larger of its roofline and the host's work to issue it (cost_models.roofline.op_time_ms)
    assert above == pytest.approx(max(compute_ms(10 * ridge * nbytes), spec.launch_overhead_ms))
    assert below == pytest.approx(max(memory_ms, spec.launch_overhead_ms))
    assert cm.op_time_ms("matmul", 1e3, 1e3, spec, dtype) == spec.launch_overhead_ms  # tiny: host-bound
    assert cm.op_time_ms("matmul", 1e3, 1e3, spec, dtype, ops=2) == 2 * spec.launch_overhead_ms
    # At the ridge both bounds agree.
    assert compute_ms(ridge * nbytes) == pytest.approx(memory_ms)


def test_dtype_fallback_and_vector_rate() -> None:
    v100, h100 = cm.get_device("V100-32GB"), cm.get_device("H100-80GB")
    assert cm.peak_rate(v100, "bfloat16") == v100.peak_flops["float32"]
    assert cm.peak_rate(v100, "float8") == v100.peak_flops["float16"]
    assert cm.peak_rate(h100, "bfloat16", "elementwise") == h100.peak_flops["float32"]
    assert cm.peak_rate(h100, "bfloat16", "matmul") == h100.peak_flops["bfloat16"]
    with pytest.raises(ValueError, match="int3"):
        cm.op_time_ms("matmul", 1, 1, h100, "int3")
    with pytest.raises(ValueError, match="gemm"):
        cm.op_time_ms("gemm", 1, 1, h100)
    with pytest.raises(ValueError):
        cm.op_time_ms("matmul", -1, 1, h100)


def test_view_costs_only_a_tiny_overhead() -> None:
    spec = cm.get_device("A100-80GB")
    view = cm.op_time_ms("view", 1e12, 1e12, spec)
    assert 0 < view < spec.launch_overhead_ms
    assert view < cm.op_time_ms("elementwise", 1, 4, spec)


# ---------------------------------------------------------------- comm

def test_ring_allreduce_matches_hand_computation() -> None:
    link = LinkSpec("test", gbps=10.0, latency_us=20.0, source="test")
    # 2(n-1) alpha + 2(n-1)/n B / bw with n=4, B=1 GB: 6 * 0.02 ms + 1.5 * 100 ms.
    assert cm.allreduce_ms(1e9, 4, link) == pytest.approx(0.12 + 150.0)
    # tree: 2 ceil(log2 4) (alpha + B / bw) = 4 * (0.02 + 100) ms.
    assert cm.allreduce_ms(1e9, 4, link, algo="tree") == pytest.approx(4 * 100.02)
    assert cm.p2p_ms(1e9, link) == pytest.approx(100.02)
    assert cm.reduce_scatter_ms(1e9, 4, link) == pytest.approx(3 * 0.02 + 75.0)
    assert cm.all_gather_ms(1e9, 4, link) == pytest.approx(3 * 0.02 + 75.0)
    assert cm.broadcast_ms(1e9, 5, link) == pytest.approx(3 * 100.02)


def test_gloo_loopback_matches_its_measurements() -> None:
    link, nbytes = cm.get_link("gloo-loopback"), 64 * 2**20
    assert 17 <= cm.p2p_ms(nbytes, link) <= 22
    assert 40 <= cm.allreduce_ms(nbytes, 2, link) <= 57


collectives = st.sampled_from([
    lambda b, n, link: cm.allreduce_ms(b, n, link),
    lambda b, n, link: cm.allreduce_ms(b, n, link, algo="tree"),
    cm.reduce_scatter_ms, cm.all_gather_ms, cm.broadcast_ms])


@FAST
@given(fn=collectives, link=st.sampled_from(cm.known_links()),
       nbytes=st.floats(min_value=0, max_value=1e12), more=st.floats(0, 1e12),
       n=st.integers(1, 1024), extra=st.integers(0, 64))
def test_collectives_are_zero_for_one_rank_and_monotone(fn, link: str, nbytes: float,
                                                        more: float, n: int,
                                                        extra: int) -> None:
    spec = cm.get_link(link)
    assert fn(nbytes, 1, spec) == 0.0
    base = fn(nbytes, n, spec)
    assert base >= 0
    assert fn(nbytes + more, n, spec) >= base
    assert fn(nbytes, n + extra, spec) >= base


def test_comm_rejects_bad_arguments() -> None:
    link = cm.get_link("pcie4")
    with pytest.raises(ValueError, match="n"):
        cm.allreduce_ms(1e6, 0, link)
    with pytest.raises(ValueError):
        cm.allreduce_ms(1e6, 4, link, algo="butterfly")
    with pytest.raises(ValueError):
        cm.p2p_ms(-1, link)


# ---------------------------------------------------------------- calibration

FITTED_KINDS = ["matmul", "norm", "softmax", "elementwise", "conv"]


def _samples(device: DeviceSpec, truth: dict[str, float], overhead: float, noise: float,
             seed: int) -> list[OpSample]:
    rng = random.Random(seed)
    out = []
    for kind, m in truth.items():
        for n in (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10):  # up to roofline-dominated
            intensity = 300.0 if kind in ("matmul", "conv") else 0.5
            flops, nbytes = intensity * n, n
            ms = m * cm.roofline_ms(kind, flops, nbytes, device) + overhead
            out.append(OpSample(kind, flops, nbytes, ms * (1 + rng.uniform(-noise, noise))))
    out += [OpSample("view", 0, 0, cm.VIEW_OVERHEAD_FRACTION * overhead + 1e-9)] * 3
    return out


@FAST
@given(multipliers=st.lists(st.floats(0.3, 5.0), min_size=len(FITTED_KINDS),
                            max_size=len(FITTED_KINDS)),
       overhead=st.floats(0.0, 0.05), seed=st.integers(0, 2**16),
       device=st.sampled_from(["A100-80GB", "T4"]))
def test_fit_recovers_known_multipliers(multipliers: list[float], overhead: float, seed: int,
                                        device: str) -> None:
    spec = cm.get_device(device)
    truth = dict(zip(FITTED_KINDS, multipliers, strict=True))
    cal = cm.fit(_samples(spec, truth, overhead, noise=0.02, seed=seed), spec)
    for kind, m in truth.items():
        assert cal.multipliers[kind] == pytest.approx(m, rel=0.05), kind
    assert cal.multipliers["attention"] == 1.0  # no samples: stays 1
    assert cal.device_kind == device


def test_fit_is_robust_to_an_outlier() -> None:
    spec = cm.get_device("A100-80GB")
    samples = _samples(spec, {"norm": 2.0, "matmul": 1.2}, 0.01, noise=0.0, seed=0)
    samples[2] = OpSample("norm", samples[2].flops, samples[2].mem_bytes, samples[2].ms * 20)
    cal = cm.fit(samples, spec)
    assert cal.multipliers["norm"] == pytest.approx(2.0, rel=0.05)
    assert cal.multipliers["matmul"] == pytest.approx(1.2, rel=0.05)


def test_calibration_applies_on_its_device_and_transfers_to_others() -> None:
    a100, h100 = cm.get_device("A100-80GB"), cm.get_device("H100-80GB")
    cal = Calibration("A100-80GB", "float32", {"norm": 4.0, "softmax": 100.0,
                                               "elementwise": 0.01}, overhead_ms=0.02)
    roof = cm.roofline_ms("norm", 1e6, 1e8, a100)
    assert cm.predict_ms("norm", 1e6, 1e8, a100, calib=cal) == pytest.approx(4 * roof + 0.02)
    assert cal.multiplier("norm", h100) == pytest.approx(2.0)  # sqrt
    assert cal.multiplier("softmax", h100) == pytest.approx(4.0)  # upper clamp
    assert cal.multiplier("elementwise", h100) == pytest.approx(0.8)  # GPU memory prior
    assert cal.multiplier("matmul", h100) == 1.0
    expected = max(2.0 * cm.roofline_ms("norm", 1e6, 1e8, h100), h100.launch_overhead_ms)
    assert cm.predict_ms("norm", 1e6, 1e8, h100, calib=cal) == pytest.approx(expected)


def test_calibration_json_round_trip_and_errors() -> None:
    spec = cm.get_device("T4")
    cal = cm.fit(_samples(spec, {"norm": 1.7}, 0.004, noise=0.0, seed=1), spec)
    back = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back == cal and hash(back) == hash(cal)
    good = cal.to_dict()
    for patch, field in [({"version": 99}, "version"),
                         ({"multipliers": {"bogus": 1.0}}, "bogus"),
                         ({"multipliers": {"norm": -1.0}}, "multipliers.norm"),
                         ({"overhead_ms": "fast"}, "overhead_ms"),
                         ({"dtype": "int7"}, "dtype")]:
        with pytest.raises(ValueError, match=field):
            Calibration.from_dict({**good, **patch})
    with pytest.raises(ValueError, match="device_kind"):
        Calibration.from_dict({k: v for k, v in good.items() if k != "device_kind"})


def test_fit_on_the_host_cpu_end_to_end() -> None:
    cpu = cm.host_cpu()
    samples = _samples(cpu, {"softmax": 3.0}, cpu.launch_overhead_ms, noise=0.0, seed=2)
    cal = cm.fit(samples, cpu)
    assert cal.multipliers["softmax"] == pytest.approx(3.0, rel=0.05)
    assert math.isclose(cal.overhead_ms, cpu.launch_overhead_ms, rel_tol=0.05)
    with pytest.raises(ValueError):
        cm.fit([], cpu)
