"""agentrt.engine.client: the client side: the offline and async APIs, input processing, output processing, the engine core in its own process and the data-parallel router."""
