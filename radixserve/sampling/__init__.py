"""Sampling: llama.cpp's sampler chain, from a row of logits to the next token.

- chain.py: SamplingParams (llama.cpp's common_params_sampling), the per-sequence Sampler with
  the chain in llama.cpp's order, a grammar's reject-and-resample, n_probs before or after the
  chain, and what each row needs from the output head;
- ops.py: each sampler of the chain, and llama.cpp's mt19937 for its draws.

Imports radixserve.text (a grammar's Constraint) and radixserve.model.head (RowNeed, MAX_TOP);
neither radixserve.model nor radixserve.text imports anything from here.
"""
