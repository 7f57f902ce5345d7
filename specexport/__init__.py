"""specexport: export LLM target/draft pairs for exact speculative decoding on NVIDIA edge hardware."""

__version__ = "0.1.0"
