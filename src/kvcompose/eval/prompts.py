"""The reasoning prompts shipped with kvcompose, and a loader for the user's own."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

PACKAGED = "reasoning_prompts.json"


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Prompts from ``path`` (default: kvcompose's own reasoning prompts), at most ``limit`` of them.

    A ``.json`` file holds a list of strings, a list of ``{"prompt": ...}`` objects, or an
    object with such a list under ``"prompts"``; any other file holds one prompt per
    non-empty line.
    """
    if path is None:
        text = resources.files("kvcompose").joinpath("data", PACKAGED).read_text(encoding="utf-8")
        prompts = _from_json(json.loads(text), PACKAGED)
    else:
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"prompt file {str(path)!r} is not valid JSON ({err}); expected a list of prompts, "
                                 "or use a file not ending in .json with one prompt per line") from None
            prompts = _from_json(data, str(path))
        else:
            prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts found in {path or PACKAGED}")
    if limit is not None:
        if limit < 1:
            raise ValueError(f"the number of prompts must be >= 1, got {limit}")
        prompts = prompts[:limit]
    return prompts


def _from_json(data, where: str) -> list[str]:
    if isinstance(data, dict):
        data = data.get("prompts")
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a list of prompts (or an object with a 'prompts' list)")
    out = []
    for item in data:
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: every prompt must be a non-empty string (or {{'prompt': str}}), got {item!r}")
        out.append(text)
    return out
