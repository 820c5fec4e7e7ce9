"""The OpenAI-compatible HTTP server over `AsyncLLMEngine` (`python -m engine.serve`).

`protocol` (request/response bodies), `errors` (OpenAI's error shape), `chat` (chat templates),
`generation` (one HTTP request's engine requests, disconnect -> abort), `completions` and
`chat_completions` (the two generation routes), `sse` (event framing), `metrics` (Prometheus),
`guards` (API key and body size, before any route),
`app` (`build_app`), `server` (uvicorn, in the foreground or a background thread), `serve_options`
(the command line's server options, checked before the engine is built).
"""
