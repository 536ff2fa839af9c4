"""radixlm: a language for structured LLM programs, served by a radix-cache runtime."""

__version__ = "0.1.0"
