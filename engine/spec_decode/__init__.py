"""Speculative decoding: proposers draft tokens, the model verifies them in one forward pass,
and the rejection sampler keeps the output distribution exactly the model's."""
