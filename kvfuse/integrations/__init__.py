"""Adapters that run kvfuse inside other frameworks: :mod:`kvfuse.integrations.transformers` (Hugging Face
transformers models with kvfuse's QK-norm / RoPE / paged K-V write). Each adapter imports its framework
only when it is imported itself; ``import kvfuse`` never does."""
