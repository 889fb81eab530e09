"""agentrt.engine.worker.worker: the worker side: the model runner, attention backends, the sampler, executors and tensor-parallel groups."""
