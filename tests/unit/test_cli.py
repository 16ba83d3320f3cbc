"""The hpml-compile CLI: profile, devices, models; errors as one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpml_compile import load_profile
from hpml_compile.cli import main


def test_profile_writes_a_loadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    rc = main(["profile", "gpt-tiny", "--batch-size", "2", "--seq-len", "16", "--device-kinds", "cpu,A100-80GB",
               "--repeats", "2", "--warmup", "1", "--no-measure-links", "-o", str(out)])
    assert rc == 0
    p = load_profile(out)
    assert (p.model, p.batch_size, p.seq_len) == ("gpt-tiny", 2, 16)
    assert set(p.device_kinds) == {"cpu", "A100-80GB"}
    text = capsys.readouterr().out
    assert "A100-80GB" in text and "predicted" in text and f"wrote {out}" in text


def test_profile_from_a_factory_file(tmp_path: Path) -> None:
    src = tmp_path / "mymodel.py"
    src.write_text(textwrap.dedent("""
        import torch
        def make(batch_size=4):
            return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), (torch.randn(batch_size, 8),)
    """))
    out = tmp_path / "p.json"
    assert main(["profile", f"{src}:make", "--batch-size", "3", "--no-measure-links", "-q", "-o", str(out)]) == 0
    assert load_profile(out).batch_size == 3


@pytest.mark.parametrize(("argv", "needle"), [
    (["profile", "no-such-model"], "unknown model 'no-such-model'"),
    (["profile", "gpt-tiny", "--device-kinds", "cpu,TPU-v9"], "unknown device kind 'TPU-v9'"),
    (["profile", "hf:gpt2?n_lair=2"], "n_lair"),
])
def test_bad_input_is_one_line_and_status_2(argv: list[str], needle: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*argv, "-q", "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_devices_lists_catalog_and_writes_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.json"
    assert main(["devices", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "H100-80GB" in text and "nvlink4" in text
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and any(d["kind"] == "cpu" for d in data["devices"])


def test_models_lists_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    for name in ("gpt2-small", "llama-70b", "resnet50", "mlp"):
        assert name in text


@pytest.mark.dist
def test_help_explains_each_command() -> None:
    out = subprocess.run([sys.executable, "-m", "hpml_compile", "profile", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--meta" in out and "hf:<model_type>" in out and "--device-kinds" in out


@pytest.mark.dist
def test_llama_7b_meta_profile_fits_in_3_gb(tmp_path: Path) -> None:
    """The acceptance command: predicted costs for a 7B model without its weights."""
    out = tmp_path / "p.json"
    # the command's own peak, reported by its process (the test process's RUSAGE_CHILDREN keeps the largest child
    # of every earlier test too)
    # VmHWM, not ru_maxrss: a forked child's ru_maxrss starts at its parent's RSS, and exec keeps it
    own_peak = ("import sys; from hpml_compile.cli import main; rc = main(sys.argv[1:]); "
                "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]; "
                "print('peak-rss-kib', hwm); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", own_peak, "profile", "llama-7b", "--meta", "--device-kinds",
                        "A100-80GB,H100-80GB", "-q", "-o", str(out)], capture_output=True, text=True, check=True,
                       timeout=300)
    peak_kib = int(r.stdout.split("peak-rss-kib")[-1].split()[0])
    assert 0 < peak_kib < 3 * 1024 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"
    p = load_profile(out)
    assert p.total("H100-80GB").fwd_ms < p.total("A100-80GB").fwd_ms
    assert sum(n.param_bytes for n in p.nodes) == pytest.approx(6.74e9 * 4, rel=0.01)
