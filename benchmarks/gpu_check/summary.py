"""Stage records and the summary of the GPU check: standard library only, so the shell
script can record its own stages and still summarise a run whose Python driver died.

A stage record is `<work>/stages/<NN>-<name>.json`: {"stage", "status" ("ok", "failed",
"timed out", "skipped"), "seconds", and "result" or "error"}; its log is
`<work>/logs/<NN>-<name>.log`. `write` rebuilds what comes back in the output folder:
summary.json (every record) and gpu_check.log (every log, in stage order, each cut to its
last LOG_TAIL_BYTES), and returns the one summary line.

    python summary.py record WORK NN NAME STATUS SECONDS [KEY=VALUE ...]
    python summary.py write WORK OUT [--dry-run]      # prints the summary line
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LOG_TAIL_BYTES = 1_500_000
STATUSES = ("ok", "failed", "timed out", "skipped")


def record(work: Path, index: int, name: str, status: str, seconds: float, **fields) -> Path:
    """Write one stage's record (replacing an earlier one of the same stage)."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {STATUSES}")
    path = work / "stages" / f"{index:02d}-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"stage": name, "status": status, "seconds": round(seconds, 1), **fields}
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def amend(work: Path, index: int, name: str, **fields) -> None:
    """Add fields to a stage's record (the driver adds the CPU time the child used)."""
    path = work / "stages" / f"{index:02d}-{name}.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **fields}, indent=1, default=str))


def log_path(work: Path, index: int, name: str) -> Path:
    path = work / "logs" / f"{index:02d}-{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def records(work: Path) -> list[dict]:
    rows = []
    for path in sorted((work / "stages").glob("*.json")):
        try:
            rows.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            rows.append({"stage": path.stem, "status": "failed", "seconds": 0, "error": str(exc)})
    return rows


def line(rows: list[dict], dry_run: bool) -> str:
    """One line: every stage's status and time, then the verdict."""
    parts = []
    for row in rows:
        status = "ok" if row["status"] == "ok" else row["status"].upper()
        parts.append(f"{row['stage']} {status} {row['seconds']:.0f}s")
    failed = [r["stage"] for r in rows if r["status"] not in ("ok",)]
    verdict = (
        "all passed" if rows and not failed else f"FAILED: {', '.join(failed) or 'nothing ran'}"
    )
    total = sum(r["seconds"] for r in rows)
    mode = " (dry run)" if dry_run else ""
    return f"gpu_check summary{mode}: {' | '.join(parts)} => {verdict} ({total:.0f}s of stages)"


def write(work: Path, out: Path, dry_run: bool = False) -> str:
    rows = records(work)
    summary_line = line(rows, dry_run)
    ok = bool(rows) and all(r["status"] == "ok" for r in rows)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"ok": ok, "dry_run": dry_run, "line": summary_line, "stages": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    with open(out / "gpu_check.log", "wb") as log:
        for path in sorted((work / "logs").glob("*.log")):
            data = path.read_bytes()
            cut = len(data) > LOG_TAIL_BYTES
            log.write(f"===== {path.stem}{' (last bytes)' if cut else ''} =====\n".encode())
            log.write(data[-LOG_TAIL_BYTES:] if cut else data)
            log.write(b"\n")
        log.write((summary_line + "\n").encode())
    return summary_line


def main(argv: list[str]) -> int:
    if len(argv) >= 6 and argv[0] == "record":
        _, work, index, name, status, seconds, *pairs = argv
        fields = dict(p.split("=", 1) for p in pairs)
        record(Path(work), int(index), name, status, float(seconds), **fields)
        return 0
    if len(argv) >= 3 and argv[0] == "write":
        summary_line = write(Path(argv[1]), Path(argv[2]), dry_run="--dry-run" in argv[3:])
        print(summary_line)
        return 0 if json.loads((Path(argv[2]) / "summary.json").read_text())["ok"] else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
