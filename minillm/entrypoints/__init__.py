"""The outside world's doors: the command line and the OpenAI-compatible HTTP server (chapter 05).

    minillm.entrypoints.cli      the `minillm` command (generate, serve, bench, eval, grade, ...)
    minillm.entrypoints.server   `minillm serve`: /v1/completions, /v1/chat/completions, /v1/models, /metrics

They sit on top: nothing else in minillm imports them.
"""
