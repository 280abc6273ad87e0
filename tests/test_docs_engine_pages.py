"""The engine's task pages stay true to the code.

`docs/offline.md` lists every `SamplingParams` field with its default and every
`EngineConfig` argument with its default, and each flag it names is one `tandem worker`
takes; `docs/speculative-decoding.md` lists every `speculative_config` key with its default.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tandem.cli import build_parser
from tandem.engine.config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec_decode.config import SpeculativeConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
INTERNAL = {"enable_kv_events"}  # set by the worker from --grpc-port, not a user argument


def _table_after(text: str, heading: str) -> list[list[str]]:
    """The data rows (cells stripped) of the first Markdown table under `heading`."""
    rows: list[list[str]] = []
    for line in text[text.index(f"\n{heading}\n"):].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # without the header and its rule


def _names(cell: str) -> list[str]:
    return re.findall(r"`([a-z_]+)`", cell)


def _defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls) if not f.name.startswith("_")}


def _first_default(cell: str) -> str:
    """The cell's leading value: `"auto"` -> auto, `4` -> 4, `None: ...` -> None."""
    return re.match(r'"?([\w.-]+)"?', cell.strip("`")).group(1)


def _documented(rows: list[list[str]], column: int) -> dict[str, str]:
    """name -> its default cell; a row naming several fields gives each its own of the
    cell's comma-separated values (or the one value to all)."""
    out: dict[str, str] = {}
    for row in rows:
        names = _names(row[0])
        values = [v.strip() for v in row[column].split(", ")]
        for i, name in enumerate(names):
            out[name] = values[i] if len(values) == len(names) else row[column]
    return out


def test_offline_sampling_params_table_is_every_field_with_its_default() -> None:
    rows = _table_after((DOCS / "offline.md").read_text(), "## `SamplingParams`")
    documented = _documented(rows, 1)
    defaults = _defaults(SamplingParams)
    assert sorted(documented) == sorted(defaults)
    for name, cell in documented.items():
        assert _first_default(cell) == str(defaults[name]), name


def test_offline_engine_table_is_every_argument_and_real_flags() -> None:
    rows = _table_after((DOCS / "offline.md").read_text(), "## Engine arguments")
    documented = _documented(rows, 2)
    defaults = _defaults(EngineConfig)
    assert sorted(documented) == sorted(set(defaults) - INTERNAL)
    for name, cell in documented.items():
        if defaults[name] is not None and not isinstance(defaults[name], tuple):
            assert _first_default(cell) == str(defaults[name]), name
    worker = build_parser()._subparsers._group_actions[0].choices["worker"]
    flags = {s for a in worker._actions for s in a.option_strings}
    named = {f for row in rows for f in re.findall(r"`(--?[a-z][a-z-]*)", row[1])}
    assert len(named) > 25 and sorted(named - flags) == []


def test_speculative_keys_table_is_every_key_with_its_default() -> None:
    rows = _table_after((DOCS / "speculative-decoding.md").read_text(), "## Proposers and keys")
    documented = _documented(rows, 1)
    defaults = _defaults(SpeculativeConfig)
    assert sorted(documented) == sorted(defaults)
    for name, cell in documented.items():
        want = defaults[name]
        if want is dataclasses.MISSING:
            assert cell == "required", name
        else:
            assert cell == ("none" if want is None else str(want).lower()), name
