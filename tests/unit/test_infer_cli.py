"""The inference commands in one process (a one-stage plan starts no ranks): plan and compile with
--inference, generate from text, from token ids and from saved weights, and bad input refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

from hpml_compile import models
from hpml_compile.cli import main
from hpml_compile.infer.api import generate


def _eager(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_plan_compile_and_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt-tiny", "--inference", "--cluster", "local-cpu-1", "--batch-size", "2",
                 "-o", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["kind"] == "inference"
    said = capsys.readouterr().out
    assert "a hand-off between two ranks of this host" in said and "to a rank idle before it for 0.1/" in said, said
    build = tmp_path / "build"
    assert main(["compile", "gpt-tiny", "--inference", "--cluster", "local-cpu-1", "--batch-size", "2",
                 "--prompt-len", "8", "--new-tokens", "8", "-o", str(build)]) == 0
    capsys.readouterr()
    assert main(["generate", str(build), "--tokens", "104,105", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    eager = models.load("gpt-tiny", seed=0).module.eval()
    want = _eager(eager, [104, 105], 4)
    assert repr(bytes(want).decode("utf-8", errors="replace")) in out.out
    assert "measured" in out.err and "predicted" in out.err


def test_generation_reads_saved_weights(tmp_path: Path) -> None:
    trained = models.load("gpt-tiny", seed=7).module.eval()  # stands in for a model trained elsewhere
    save_model(trained, str(tmp_path / "w.safetensors"))
    build = tmp_path / "build"
    assert main(["compile", "gpt-tiny", "--inference", "--cluster", "local-cpu-1", "--batch-size", "2",
                 "--prompt-len", "8", "--new-tokens", "8", "--weights", str(tmp_path / "w.safetensors"),
                 "-o", str(build)]) == 0
    prompts = [[3, 1, 4], [1, 5]]
    got = generate(build, prompts, max_new_tokens=5).tokens
    assert got == [_eager(trained, p, 5) for p in prompts]
    assert got != [_eager(models.load("gpt-tiny", seed=0).module.eval(), p, 5) for p in prompts]


def test_bad_input_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build = tmp_path / "build"
    assert main(["compile", "gpt-tiny", "--inference", "--cluster", "local-cpu-1", "--prompt-len", "8",
                 "--new-tokens", "8", "-o", str(build)]) == 0
    capsys.readouterr()
    assert main(["generate", str(build), "--tokens", "1,x"]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert main(["generate", str(build), "--tokens", "1,300"]) == 2
    assert "outside 0..255" in capsys.readouterr().err
    assert main(["generate", str(build), "--prompt", "hi", "--max-new-tokens", "40"]) == 2
    assert "context of 32" in capsys.readouterr().err
    assert main(["compile", "gpt-tiny", "--inference", "--cluster", "local-cpu-1", "--weights",
                 str(tmp_path / "none.safetensors"), "-o", str(tmp_path / "b2")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["compile", "gpt-tiny", "--inference", "--cluster", "local-cpu-1", "--compile-stages", "on",
                 "-o", str(tmp_path / "b3")]) == 2
    assert "inference stages run eager" in capsys.readouterr().err and not (tmp_path / "b3").exists()
    # serve's drill and deadlines: refused by name before any rank starts or port opens
    assert main(["serve", str(build), "--slow", "1:3:1"]) == 2
    assert "rank 1 is not a rank of the plan (0..0)" in capsys.readouterr().err
    assert main(["serve", str(build), "--slow", "0:0.5:1"]) == 2
    assert "FACTOR must be a number >= 1" in capsys.readouterr().err
    assert main(["serve", str(build), "--header-timeout-s", "0"]) == 2
    assert "--header-timeout-s must be > 0" in capsys.readouterr().err
    assert main(["serve", str(build), "--adapt-threshold", "1"]) == 2
    assert "--adapt-threshold must be > 1" in capsys.readouterr().err
