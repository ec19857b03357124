"""The OpenAI-compatible server (``deepinfer serve``): FastAPI app, asynchronous front end over
the engine, safe chat encoding, Prometheus metrics. Needs the ``serve`` extra."""
