"""An agent with two real tools: arithmetic, and a lookup in a local JSON file. Every model
reply is grammar-constrained to a valid call of one of the tools (or the final answer), the
tools run, and their results go back to the model until it answers.

The embedded 135M model is small: it calls the tools correctly-shaped every time (the grammar
sees to that), but its choices are not always wise — the trace shows exactly what happened."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import anyio
from pydantic import BaseModel, Field

import agentrt

CATALOG = Path(__file__).with_name("data") / "products.json"
# The parameter type lists the catalog's products, so the grammar only lets the model name
# one that exists.
ProductName = Literal[tuple(json.loads(CATALOG.read_text()))]


@agentrt.tool
def lookup_product(name: ProductName) -> dict:
    """Look up a product in the catalog: price in EUR, units in stock, warehouse."""
    return json.loads(CATALOG.read_text())[name]


@agentrt.tool
def calculate(a: float, op: str, b: float) -> float:
    """Compute `a op b` where op is one of + - * /."""
    ops = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}
    if op not in ops:
        raise ValueError(f"unknown operator {op!r}; use + - * /")
    return ops[op]


class Quote(BaseModel):
    product: str = Field(max_length=40)
    quantity: int = Field(ge=1, le=1000)
    total_eur: float = Field(ge=0)


async def main() -> None:
    async with agentrt.Runtime() as rt:
        await run(rt)


async def run(rt: agentrt.Runtime) -> None:
    agent = agentrt.Agent(
        rt,
        tools=[lookup_product, calculate],
        system="You are a sales assistant. Look products up, compute totals with the "
        "calculator, then give the final answer.",
        output=Quote,
        max_steps=4,
        tool_choice="lookup_product",  # first step: look the product up
        max_tokens=120,
    )
    task = "A customer wants 3 espresso machines. What is the total price?"
    print(f"task: {task}")
    try:
        result = await agent.run(task)
        steps, answer = result.steps, result.output
    except agentrt.AgentError as exc:
        steps, answer = exc.trace.steps, f"(no final answer: {exc})"
    for number, step in enumerate(steps, 1):
        for call, res in zip(step.calls, step.results or [None] * len(step.calls), strict=True):
            outcome = "" if res is None else f" -> {res.error or res.output}"
            print(f"step {number}: {call.name}({call.arguments}){outcome}")
        if not step.calls:
            print(f"step {number}: {step.text.strip()}")
    print(f"answer: {answer!r}")


if __name__ == "__main__":
    anyio.run(main)
