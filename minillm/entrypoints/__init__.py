"""The outside world's HTTP door: the OpenAI-compatible server (chapter 05).

    minillm.entrypoints.server   `minillm serve`: /v1/completions, /v1/chat/completions, /v1/models, /metrics

The `minillm` command itself is `minillm.cli`, one floor up: it offers the engine's commands (generate, serve,
bench, eval, ...) and the book's (grade, drill, book), so it is the one module that imports both.
Nothing else in minillm imports this room.
"""
