"""One rank of tests/test_hub.py's ordering check, launched by torchrun: `local_main_first` runs the first call on
local rank 0 before any other rank's, and a first call's error reaches every rank.

argv: OUT_DIR. Writes OUT_DIR/rank<r>.json: what this rank's calls saw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from isotrain.errors import ConfigError
from isotrain.parallel.dist import init_distributed, local_main_first, shutdown_distributed


def main(out_dir: Path) -> None:
    info = init_distributed()
    marker = out_dir / "fetched-by-first"
    seen = {}

    def fetch(first: bool) -> str:
        # The first call leaves its file; a later call must find it in place (a cache read, never a download).
        if first:
            marker.write_text(str(info.rank))
            return "fetched"
        return f"read {marker.read_text()}" if marker.is_file() else "missing"

    seen["ok"] = local_main_first(info.local_rank, fetch)

    def fail(first: bool) -> None:
        raise ConfigError(f"refused on rank {info.rank} (first={first})")

    try:
        local_main_first(info.local_rank, fail)
        seen["error"] = None
    except ConfigError as err:
        seen["error"] = str(err)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(seen))
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
