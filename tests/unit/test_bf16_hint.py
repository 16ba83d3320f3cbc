"""On a cluster of GPUs with bf16 units, plan and compile say what the bf16 plan would predict (fp32 stays)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpml_compile import models
from hpml_compile.cli.bf16hint import bf16_gpus
from hpml_compile.cli import main
from hpml_compile.cluster import load_cluster
from hpml_compile.profile import profile, save_profile

HINT = re.compile(r"bf16: every device of dgx-h100-8 \(H100-80GB\) has bf16 units: the bf16 plan's step is "
                  r"predicted ([\d.]+) ms against ([\d.]+) ms in fp32 .*--precision bf16")


def _meta_profile(tmp_path: Path) -> Path:
    """A predicted H100 profile of the zoo MLP at a batch where matmuls dominate (nothing is timed)."""
    loaded = models.load("mlp", batch_size=4096, device="meta")
    prof = profile(loaded.module, loaded.example_inputs, name="mlp", device_kinds=("H100-80GB",), progress=False)
    return save_profile(prof, tmp_path / "profile.json")


def test_only_clusters_whose_every_device_is_a_gpu_with_bf16_units_get_the_hint() -> None:
    assert bf16_gpus(load_cluster("dgx-h100-8")) == ["H100-80GB"]
    assert bf16_gpus(load_cluster("local-cpu-2")) == [] and bf16_gpus(load_cluster("hetero-4")) == []


def test_plan_prints_the_bf16_step_beside_the_fp32_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _meta_profile(tmp_path)
    assert main(["plan", str(prof), "--cluster", "dgx-h100-8", "--solver", "dp", "-o", str(tmp_path / "p.json")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bf16:")]
    assert len(lines) == 1, "one line"
    found = HINT.match(lines[0])
    assert found, lines[0]
    bf16_ms, fp32_ms = float(found[1]), float(found[2])
    assert bf16_ms < fp32_ms, "a matmul-bound model is predicted faster at the bf16 rate"
    assert '"precision": "fp32"' in (tmp_path / "p.json").read_text(), "the plan itself stays fp32"


def test_a_chosen_precision_gets_no_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _meta_profile(tmp_path)
    assert main(["plan", str(prof), "--cluster", "dgx-h100-8", "--solver", "dp", "--precision", "fp32",
                 "-o", str(tmp_path / "p.json")]) == 0
    assert "bf16:" not in capsys.readouterr().out


def test_compile_prints_the_hint_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "mlp-tiny", "--batch-size", "4", "--cluster", "dgx-h100-8", "--solver", "dp",
                 "--repeats", "1", "--warmup", "0", "-o", str(tmp_path / "build")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bf16:")]
    assert len(lines) == 1 and HINT.match(lines[0]), lines
