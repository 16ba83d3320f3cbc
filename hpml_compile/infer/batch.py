"""Batch inference over a JSONL file, resumable after a kill without repeating or skipping an item.

Each input line is an object with ``"prompt"`` (text: its UTF-8 bytes are
the token ids of the zoo's byte-level models) or ``"tokens"`` (a list of
ids), and optionally ``"max_new_tokens"`` and an ``"id"`` copied to the
output. Items run in file order, ``batch`` at a time, through a
:class:`~hpml_compile.infer.engine.Generator`; each output line carries the
item's ``index``, its ``id``, the new ``tokens`` and, where every token is a
byte, their ``text``.

Resuming: results go to ``OUT.partial``, each batch appended, flushed and
fsynced before the next starts, beside ``OUT.partial.json`` recording the
input's sha256. A run that finds them keeps every whole line (a line cut by
the kill is dropped), checks that the lines are items ``0..k-1`` of the
same input, and starts at item ``k``. When every item is done the partial
file is renamed to ``OUT`` in one step, so ``OUT`` is whole or absent.

Example:
    >>> encode_item({"prompt": "hi"}, 0)
    [104, 105]
    >>> decode_tokens([104, 105])
    'hi'
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import HpmlError
from ..schema import write_json_atomic

__all__ = ["encode_item", "decode_tokens", "read_items", "run_batch"]


def encode_item(item: Any, index: int, where: str = "item") -> list[int]:
    """The prompt token ids of one request object (``prompt`` text or ``tokens`` ids).

    Raises:
        HpmlError: naming ``where`` and ``index`` when the object has neither, or a wrong type.
    """
    if not isinstance(item, dict):
        raise HpmlError(f"{where} {index}: expected an object with \"prompt\" (text) or \"tokens\" (ids), "
                        f"got {type(item).__name__}")
    if "tokens" in item:
        toks = item["tokens"]
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise HpmlError(f"{where} {index}: \"tokens\" must be a list of integer ids")
        return list(toks)
    if isinstance(item.get("prompt"), str):
        return list(item["prompt"].encode("utf-8"))
    raise HpmlError(f"{where} {index}: expected \"prompt\" (a string) or \"tokens\" (a list of ids)")


def decode_tokens(tokens: Sequence[int]) -> str | None:
    """The text of byte-level tokens (invalid UTF-8 replaced), or None when an id is not a byte."""
    if any(not 0 <= t < 256 for t in tokens):
        return None
    return bytes(tokens).decode("utf-8", errors="replace")


def read_items(path: Path) -> tuple[list[dict[str, Any]], str]:
    """Every JSON object of a JSONL file (blank lines skipped) and the file's sha256.

    Raises:
        HpmlError: for a missing file or a line that is not JSON, naming the line.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise HpmlError(f"infer: cannot read --data {path}: {e.strerror or e}") from None
    items = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise HpmlError(f"infer: {path} line {n} is not JSON ({e.msg}); each line must be one object such "
                            "as {\"prompt\": \"text\"}") from None
    return items, hashlib.sha256(raw).hexdigest()


def _resume(partial: Path, meta: Path, digest: str) -> int:
    """Items already done in ``partial`` (cut to its last whole line); 0 without one."""
    if not partial.exists():
        return 0
    if not meta.exists() or json.loads(meta.read_text()).get("data_sha256") != digest:
        raise HpmlError(f"infer: {partial} holds results of another input file; delete it (and {meta.name}) to "
                        "start over, or pass the same --data")
    data = partial.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(partial, "r+b") as f:  # the kill cut a line: drop it, it is redone
            f.truncate(len(whole))
    lines = whole.decode("utf-8").splitlines()
    for k, line in enumerate(lines):
        if json.loads(line).get("index") != k:
            raise HpmlError(f"infer: {partial} line {k + 1} is not item {k}; delete it to start over")
    return len(lines)


def run_batch(generate: Callable[[list[list[int]], int], list[list[int]]], data: Path, out: Path, *,
              batch: int, max_new_tokens: int, say: Callable[[str], None] = print) -> int:
    """Run every item of ``data`` through ``generate``, resumably (see the module docstring).

    Args:
        generate: ``(prompts, max_new_tokens) -> new tokens per prompt``.
        data: the JSONL input.
        out: the JSONL output, published when complete.
        batch: items per call.
        max_new_tokens: the default per item (an item's own ``max_new_tokens`` wins).
        say: where progress lines go.

    Returns:
        The number of items generated by this run (0 when ``out`` was already complete).

    Raises:
        HpmlError: on a bad input line or a partial output of another input.
    """
    items, digest = read_items(data)
    prompts = [encode_item(x, i, where=f"{data} item") for i, x in enumerate(items)]
    wants = [int(x.get("max_new_tokens", max_new_tokens)) for x in items]
    partial, meta = out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not partial.exists():
        lines = out.read_text(encoding="utf-8").splitlines()
        if [json.loads(x).get("index") for x in lines] == list(range(len(items))):
            say(f"{out} already holds all {len(items)} items; nothing to do")
            return 0
        raise HpmlError(f"infer: {out} exists and is not this input's complete output; move it away or choose "
                        "another -o")
    done = _resume(partial, meta, digest)
    if done == 0:
        write_json_atomic({"data_sha256": digest, "data": str(data)}, meta)
    elif done:
        say(f"resuming after item {done - 1}: {done} of {len(items)} already done")
    t0, made = time.perf_counter(), 0
    with open(partial, "ab") as f:
        for start in range(done, len(items), batch):
            idx = list(range(start, min(start + batch, len(items))))
            new = generate([prompts[i] for i in idx], max(wants[i] for i in idx))
            lines = []
            for i, toks in zip(idx, new):
                toks = toks[:wants[i]]
                row = {"index": i, **({"id": items[i]["id"]} if "id" in items[i] else {}), "tokens": toks}
                text = decode_tokens(toks)
                if text is not None:
                    row["text"] = text
                lines.append(json.dumps(row) + "\n")
            f.write("".join(lines).encode())
            f.flush()
            os.fsync(f.fileno())
            made += len(idx)
            rate = made / max(time.perf_counter() - t0, 1e-9)
            say(f"{idx[-1] + 1}/{len(items)} items ({rate:.3g} items/s)")
    os.replace(partial, out)
    meta.unlink(missing_ok=True)
    return made
