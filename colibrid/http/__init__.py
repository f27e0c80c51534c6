"""The HTTP API: OpenAI- and Anthropic-compatible routes served by hypercorn inside the
daemon nursery. Translators are pure; only `app.py` does I/O, and it talks to the same
scheduler as the SERVE sessions (never to the engine)."""
