"""`@agentrt.tool`: a typed Python function (sync or async) as a tool — its name, its
docstring as the description, and a JSON schema of its parameters derived by Pydantic from
the signature.

A call's arguments are checked once for the schema, by the grammar and the final check of
the reply (agentrt.formats lists which check lives where); `Tool.call` then builds the typed
values the function receives with the same Pydantic model. That is the conversion, not a
second schema check: it only fails on what no JSON schema says (validators, custom types),
or for arguments that did not come from a constrained reply.

A `ToolSource` gives an Agent tools it only knows once open (an MCP server's, agentrt.mcp):
they are called with the arguments object as it is (`arguments_model` None), their schema
being the source's."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import pydantic

from agentrt.errors import SchemaError


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]
    # None: `fn` is async and takes the arguments object whole (a ToolSource's tool).
    arguments_model: type[pydantic.BaseModel] | None

    def definition(self) -> dict[str, Any]:
        """The OpenAI-format tool definition."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    async def call(self, arguments: dict[str, Any]) -> Any:
        """Build the typed arguments and run the function (a sync one in a worker thread).
        Raises pydantic's ValidationError for bad arguments, or what the function raises."""
        if self.arguments_model is None:
            return await self.fn(arguments)
        values = self.arguments_model.model_validate(arguments)
        kwargs = {name: getattr(values, name) for name in type(values).model_fields}
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**kwargs)
        return await anyio.to_thread.run_sync(functools.partial(self.fn, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)  # the decorated function still works as before


class ToolSource(Protocol):
    """Tools known once open (agentrt.mcp.MCPSession). `open()` returns them (again if
    already open); `close()` releases what open took (a no-op once closed)."""

    async def open(self) -> list[Tool]: ...

    async def close(self) -> None: ...


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None
) -> Any:
    """`@tool` or `@tool(name=..., description=...)`. Every parameter needs a type annotation."""

    def wrap(fn: Callable[..., Any]) -> Tool:
        return _make_tool(fn, name or fn.__name__, description)

    return wrap(fn) if fn is not None else wrap


def _make_tool(fn: Callable[..., Any], name: str, description: str | None) -> Tool:
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn, eval_str=True).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise SchemaError(f"tool {name}: *args / **kwargs cannot be described as a schema.")
        if param.annotation is inspect.Parameter.empty:
            raise SchemaError(f"tool {name}: parameter {param.name!r} needs a type annotation.")
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (param.annotation, default)
    try:
        model = pydantic.create_model(
            f"{name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        parameters = model.model_json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError) as exc:
        raise SchemaError(f"tool {name}: cannot describe its parameters: {exc}") from None
    parameters.pop("title", None)
    doc = description if description is not None else inspect.getdoc(fn) or ""
    return Tool(name, doc.strip(), parameters, fn, model)
