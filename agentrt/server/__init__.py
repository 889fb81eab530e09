"""`agentrt serve`: an OpenAI-compatible HTTP server on the agentrt engine (FastAPI + uvicorn).

`agentrt.server.app.create_app(ServerConfig(...))` builds the ASGI app;
`agentrt.server.serve.serve(...)` runs it with graceful drain on SIGTERM. Importing this
package needs neither fastapi nor uvicorn (the CLI builds its parser from `cli`).
"""
