"""The online front: `AsyncLLMEngine` for servers and the hosts that step the engine for it
(`ThreadHost`: a thread of the server's process; `ProcessHost`: the engine core's own process)."""
