"""A multi-turn chat session on the embedded model: plain-text turns, a structured turn that
returns a Pydantic object, streaming, and a fork — with the prefix cache serving every turn's
history (see the cached-token counts)."""

from __future__ import annotations

import anyio
from pydantic import BaseModel, Field

import agentrt


class Trip(BaseModel):
    city: str = Field(max_length=30)
    days: int = Field(ge=1, le=14)
    budget_eur: int = Field(ge=0, le=10_000)


async def main() -> None:
    async with agentrt.Runtime() as rt:
        await run(rt)


async def run(rt: agentrt.Runtime) -> None:
    session = rt.session(system="You are a concise travel assistant.", max_tokens=60)
    answer = await session.generate("Suggest one city in Italy for a weekend.")
    print(f"assistant: {answer.strip()}\n  usage: {session.last.usage}")

    trip = await session.generate("Plan that trip as JSON.", schema=Trip)
    print(f"trip: {trip!r}\n  usage: {session.last.usage}")

    print("streaming: ", end="")
    async for delta in session.stream("Name one thing to eat there."):
        print(delta, end="", flush=True)
    print(f"\n  usage: {session.last.usage}")

    branch = session.fork()  # shares the history (and its cached prefix) from here
    alt = await branch.generate("Now suggest a city in Spain instead.")
    print(f"fork: {alt.strip()}\n  usage: {branch.last.usage}")
    print(f"session totals: {session.usage}")


if __name__ == "__main__":
    anyio.run(main)
