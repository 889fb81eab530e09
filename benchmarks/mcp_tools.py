"""What an MCP tool costs the Agent beside a local `@agentrt.tool` (issue 44, item 1).

Three ways to run the same tool body (tests/agentrt/mcp_testserver.py's `warehouse_code`):
a local `@agentrt.tool`, the MCP server over stdio, and over streamable HTTP on localhost.
Per way: the time to open the session (start the process or connect, initialize, list the
tools; none for the local tool) and the time of one call (`Tool.call`, as the Agent makes
it), in alternating rounds; medians, and each MCP way's ratio to the local call measured in
the same round. A model step on the embedded model takes tens to hundreds of ms on a CPU:
the figures say how much of an agent step an MCP call adds.

    python benchmarks/mcp_tools.py --rounds 5 --calls 50
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agentrt  # noqa: E402
from tests.agentrt.mcp_testserver import HTTPServer, warehouse_code_of  # noqa: E402

SERVER = str(ROOT / "tests" / "agentrt" / "mcp_testserver.py")


@agentrt.tool
def warehouse_code(city: str) -> str:
    """The code of the company's warehouse in a city."""
    return f"The warehouse code for {city} is {warehouse_code_of(city)}."


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


async def time_calls(tool, calls: int) -> float:
    """Median seconds of one call."""
    times = []
    for i in range(calls):
        start = time.perf_counter()
        await tool.call({"city": f"City {i}"})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def measure(way: str, http_url: str, calls: int) -> tuple[float, float]:
    """(open seconds, median call seconds) of one way."""
    if way == "local":
        return 0.0, await time_calls(warehouse_code, calls)
    target = http_url if way == "http" else [sys.executable, SERVER, "stdio"]
    start = time.perf_counter()
    async with agentrt.mcp_server(target) as session:
        opened = time.perf_counter() - start
        tool = next(t for t in session.tools if t.name == "warehouse_code")
        return opened, await time_calls(tool, calls)


async def main(args: argparse.Namespace) -> None:
    ways = ("local", "stdio", "http")
    results: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    ratios: dict[str, list[float]] = {w: [] for w in ways[1:]}
    loads = [load()]
    with HTTPServer(Path(tempfile.mkdtemp()) / "log.jsonl") as http:
        for round_number in range(args.rounds):
            order = ways if round_number % 2 == 0 else ways[::-1]
            measured = {way: await measure(way, http.url, args.calls) for way in order}
            for way, value in measured.items():
                results[way].append(value)
            for way in ratios:
                ratios[way].append(measured[way][1] / measured["local"][1])
            loads.append(load())
    print(f"CPU: {cpu_model()}; load average (1 min) during the run: {', '.join(loads)}")
    print(f"{args.rounds} rounds, {args.calls} calls each, ways alternating")
    print(f"{'way':<7} {'open s':>8} {'call ms':>9} {'x local (median of rounds)':>28}")
    for way in ways:
        opened = statistics.median(o for o, _ in results[way])
        call_ms = 1e3 * statistics.median(c for _, c in results[way])
        ratio = f"{statistics.median(ratios[way]):.1f}x" if way in ratios else "1.0x"
        print(f"{way:<7} {opened:8.2f} {call_ms:9.3f} {ratio:>28}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    anyio.run(main, parser.parse_args())
