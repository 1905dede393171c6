"""The model store: names, manifests, blobs, pull sources, GGUF inspection."""
