"""Ways into minivllm over the network: ``minivllm.entrypoints.openai`` is the HTTP server."""
