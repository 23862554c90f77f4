"""What every benchmark script records: its config (arguments, machine, date) and a JSON results file."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone


def run_config(args, **extra) -> dict:
    """``vars(args)`` plus ``extra``, the machine (unless ``extra`` names it) and the UTC date; printed."""
    config = {
        **vars(args),
        **extra,
        "machine": extra.get("machine", f"{platform.machine()}, {os.cpu_count()} cores"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    print("config:", json.dumps(config))
    return config


def write_results(path: str, config: dict, rows: list, key: str = "rows") -> None:
    """Write ``{"config": config, key: rows}`` to ``path`` (folders created) and say so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"config": config, key: rows}, f, indent=1)
    print(f"wrote {path}")
