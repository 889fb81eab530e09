"""agentrt.engine.core: the engine core: the step, the scheduler, the KV cache's blocks and prefix index, structured outputs' bitmasks."""
