"""The device side: the model runner (padded inputs, compiled steps, the donated KV cache), the sampler, stored executables."""
