"""`tfq serve`: an OpenAI-compatible HTTP server over the engine, every reply exact under any load.

protocol.py: the request bodies (pydantic) and how each becomes engine requests.
loop.py: the engine in its own thread, stepping continuously; requests join and leave between steps.
replies.py: engine results as OpenAI response bodies and stream chunks.
metrics.py: the Prometheus metrics.
app.py: the FastAPI app: routes, authentication, errors.
"""
