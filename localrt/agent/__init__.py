"""The tool loop: a model's tool calls run here, on the client's side, and their results go back as
tool messages until the model answers without a call.

`loop.py` runs the loop over any `localrt.client.Client` (the chat app and `localrt run --tools` share
it); `toolbox.py` holds what the model is offered, each tool switchable; `tools/` are the built-in
tools (files rooted in the working directory, a shell, a URL fetch); `mcp.py` connects MCP servers
through the official `mcp` SDK; `approvals.py` decides which calls run without asking.

Nothing here imports the runtime, a backend, the API or an interface: the loop reaches models only
through the client, as any agent would, so it works the same on every backend and on remote models.
"""
