"""Model loading: HF-format directories, GGUF import, the embedded default model, architectures."""
