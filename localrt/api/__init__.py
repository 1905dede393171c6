"""The local HTTP API: Ollama-compatible (ollama.py) and OpenAI-compatible (openai.py) routes."""
