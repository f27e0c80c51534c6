"""The engine: prefill/decode loop, KV cache, sampling, text in and out."""
