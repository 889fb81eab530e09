"""A Responses request's `{"type": "mcp"}` tools, checked: the allow-list
(`agentrt serve --allow-mcp-servers`: `server_url` must be one of its entries exactly, else a
400 before anything is contacted), `headers` / `authorization` (HTTP servers only),
`allowed_tools` and `require_approval` (agentrt.server.responses_mcp runs them); and how
they are offered to the model (`function_tool`, `first_tool_choice`) and echoed in a
response (`echoed_tools`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrt.mcp import MCPSession, is_url
from agentrt.server.errors import bad_request
from agentrt.server.protocol import ResponsesRequest
from agentrt.server.responses_mcp_sessions import SessionKey, session_key


@dataclass(slots=True)
class MCPServerTool:
    """One checked `mcp` tool of a request, and its session once open."""

    index: int  # in `tools`
    label: str
    target: str  # the allow-listed URL or command
    headers: dict[str, str]
    allowed_tools: list[str] | None
    require_approval: Any
    session: MCPSession | None = None
    # Its tools as an `mcp_list_tools` item lists them: name, description, input_schema.
    tools: list[dict[str, Any]] = field(default_factory=list)

    @property
    def session_key(self) -> SessionKey:
        return session_key(self.label, self.target, self.allowed_tools, self.headers)

    def needs_approval(self, name: str) -> bool:
        policy = self.require_approval
        if policy == "never":
            return False
        if isinstance(policy, dict):
            never = (policy.get("never") or {}).get("tool_names") or ()
            return name not in never
        return True


def has_mcp_tools(request: ResponsesRequest) -> bool:
    return any(tool.type == "mcp" for tool in request.tools or ())


def checked_servers(request: ResponsesRequest, allowed: tuple[str, ...]) -> list[MCPServerTool]:
    """The request's mcp tools, each checked against the allow-list (400s; nothing is
    contacted here)."""
    servers: list[MCPServerTool] = []
    for index, tool in enumerate(request.tools or ()):
        if tool.type != "mcp":
            continue
        spec = tool.model_extra or {}
        param = f"tools.{index}"
        label = spec.get("server_label")
        if not isinstance(label, str) or not label:
            raise bad_request("an mcp tool needs a `server_label`.", param=f"{param}.server_label")
        if any(s.label == label for s in servers):
            raise bad_request(f"server_label {label!r} is used twice.", param=param)
        url = spec.get("server_url")
        if not isinstance(url, str):
            raise bad_request(
                "an mcp tool needs a `server_url` (connectors are OpenAI's hosted services).",
                param=f"{param}.server_url",
            )
        if not allowed:
            raise bad_request(
                "mcp tools are off on this server: its operator turns them on for chosen "
                "servers with `agentrt serve --allow-mcp-servers`.",
                param=f"{param}.server_url",
            )
        if url not in allowed:
            raise bad_request(
                f"server_url {url!r} is not an MCP server this server may use (the operator "
                "lists them with `agentrt serve --allow-mcp-servers`); nothing was contacted.",
                param=f"{param}.server_url",
            )
        servers.append(
            MCPServerTool(
                index,
                label,
                url,
                _headers(spec, url, param),
                _allowed_tools(spec.get("allowed_tools"), param),
                _approval_policy(spec.get("require_approval"), param),
            )
        )
    return servers


def function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool["description"],
        "parameters": tool["input_schema"],
    }


def first_tool_choice(choice: Any) -> Any:
    """The first turn's tool_choice: an mcp choice names a tool (or asks for any)."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type == "mcp":
        return {"type": "function", "name": choice.name} if choice.name else "required"
    return choice.model_dump(exclude_none=True)


def echoed_tools(
    request: ResponsesRequest,
    functions: list[dict[str, Any]],
    tools: dict[str, tuple[MCPServerTool, dict[str, Any]]],
) -> list[dict[str, Any]]:
    """The response's `tools`: the client's function tools and its mcp tools as sent
    (never their headers or authorization)."""
    echoed = [t for t in functions if t.get("name") not in tools]
    for tool in request.tools or ():
        if tool.type == "mcp":
            spec = tool.model_extra or {}
            echoed.append(
                {"type": "mcp"}
                | {
                    key: spec[key]
                    for key in ("server_label", "server_url", "allowed_tools", "require_approval")
                    if spec.get(key) is not None
                }
            )
    return echoed


def _headers(spec: dict[str, Any], url: str, param: str) -> dict[str, str]:
    headers = spec.get("headers") or {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise bad_request("headers must map names to strings.", param=f"{param}.headers")
    headers = dict(headers)
    if isinstance(spec.get("authorization"), str):
        headers["Authorization"] = f"Bearer {spec['authorization']}"
    if headers and not is_url(url):
        raise bad_request(
            "headers and authorization are an HTTP server's: this server_url is a command.",
            param=f"{param}.headers",
        )
    return headers


def _allowed_tools(value: Any, param: str) -> list[str] | None:
    if isinstance(value, dict):
        value = value.get("tool_names")
    if value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise bad_request(
        "allowed_tools must be a list of tool names or {'tool_names': [...]}.",
        param=f"{param}.allowed_tools",
    )


def _approval_policy(value: Any, param: str) -> Any:
    if value in (None, "always", "never"):
        return value
    if isinstance(value, dict) and set(value) <= {"always", "never"}:
        return value
    raise bad_request(
        "require_approval must be 'always', 'never' or {'always'|'never': {'tool_names': [...]}}.",
        param=f"{param}.require_approval",
    )
