"""Tiny worker for the live hand-off tests: ``ez_round_worker.py OUT_DIR`` — no torch, no training.

Appends to ``OUT_DIR/rounds.<pid>.jsonl`` one line when it starts (its pid, local rank, agent pid) and one line per
round it sees in its node's round file (``ELASTICZERO_ROUND_FILE``, polled every 20 ms through
:class:`~elasticzero.rounds.RoundFile`): the round as parsed, and the wall-clock time it saw it; a round file
that does not parse is written as an ``error`` line (once per reason). Exits 0 once ``OUT_DIR/stop`` exists.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from elasticzero.rounds import ROUND_FILE_ENV, NodeRound, RoundError, RoundFile

POLL_S = 0.02


def main() -> None:
    out = Path(sys.argv[1])
    pid = os.getpid()
    ident = {"pid": pid, "local_rank": int(os.environ["LOCAL_RANK"]), "agent": int(os.environ["ELASTICZERO_AGENT_PID"])}
    with (out / f"rounds.{pid}.jsonl").open("a", buffering=1) as log:
        log.write(json.dumps({**ident, "start": time.time()}) + "\n")
        source, current, error = RoundFile(os.environ[ROUND_FILE_ENV]), -1, ""
        while not (out / "stop").exists():
            found = source.poll(current)
            if isinstance(found, RoundError) and found.reason != error:
                error = found.reason
                log.write(json.dumps({**ident, "error": error}) + "\n")
            elif isinstance(found, NodeRound):
                current = found.number
                log.write(json.dumps({**ident, "seen": time.time(), "round": json.loads(found.to_json())}) + "\n")
            time.sleep(POLL_S)


if __name__ == "__main__":
    main()
