"""An agent with a real tool: a price lookup in a local JSON catalog. Every model reply is
grammar-constrained to a valid call of the tool or to the final answer (a `Quote`), the tool
runs, and its result goes back to the model until it answers.

The embedded 135M model is small: it calls the tool correctly-shaped every time (the grammar
sees to that), but left to itself it calls tools again and again. Two rules of `Agent` keep
it on track, both enforced by the grammar: a call already answered cannot be made again, and
the last step (`max_steps`) can only be the final answer. The task needs one lookup, so
`max_steps=2`: the model chooses its first step (here: the lookup), and the second must
answer. Given more steps it looks up other quantities before answering, and may answer with
one of those: a 135M model follows instructions loosely. The trace shows what happened."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import anyio
from pydantic import BaseModel, Field

import agentrt

CATALOG = Path(__file__).with_name("data") / "products.json"
# The parameter type lists the catalog's products, so the grammar only lets the model name
# one that exists.
ProductName = Literal[tuple(json.loads(CATALOG.read_text()))]


@agentrt.tool
def lookup_product(name: ProductName, quantity: Annotated[int, Field(ge=1, le=1000)]) -> dict:
    """Look up a product in the catalog: the total price in EUR of `quantity` units, the
    unit price, units in stock and warehouse."""
    item = json.loads(CATALOG.read_text())[name]
    total = round(item["price_eur"] * quantity, 2)
    return {"product": name, "quantity": quantity, "total_eur": total, **item}


class Quote(BaseModel):
    product: ProductName
    quantity: int = Field(ge=1, le=1000)
    total_eur: float = Field(ge=0)


TASK = "A customer wants 3 espresso machines. What is the total price?"


async def main() -> None:
    async with agentrt.Runtime() as rt:
        await run(rt)


async def run(rt: agentrt.Runtime) -> Quote | None:
    """Run the task, print the trace and return the answer (None if there is none)."""
    agent = agentrt.Agent(
        rt,
        tools=[lookup_product],
        system="You are a sales assistant. Look the product up for the quantity asked, then "
        "give the final answer.",
        output=Quote,
        max_steps=2,
        max_tokens=120,
    )
    print(f"task: {TASK}")
    try:
        result = await agent.run(TASK)
        steps, answer = result.steps, result.output
    except agentrt.AgentError as exc:
        steps, answer = exc.trace.steps, None
        print(f"(no final answer: {exc})")
    for number, step in enumerate(steps, 1):
        for call, res in zip(step.calls, step.results or [None] * len(step.calls), strict=True):
            outcome = "" if res is None else f" -> {res.error or res.output}"
            print(f"step {number}: {call.name}({call.arguments}){outcome}")
        if not step.calls:
            print(f"step {number}: {step.text.strip()}")
    print(f"answer: {answer!r}")
    return answer


if __name__ == "__main__":
    anyio.run(main)
