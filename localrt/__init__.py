"""localrt: a local LLM runtime with an Ollama-style store, three backends and local HTTP APIs."""

__version__ = "0.1.0"
