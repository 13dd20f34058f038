"""Model: the tensor compute of a GGUF model.

Hyper-parameters (hparams.py), weights and their quantized layouts (weights.py, quant.py,
qmm.py), the C kernels (csrc/, kernels.py, cabi.py, step.py), RoPE (rope.py), the batched forward
(forward.py), the output head (head.py), and loading a file into a runnable model (loader.py,
default_model.py).

Imports radixserve.text only to load the tokenizer and chat template (loader.py); nothing from
radixserve.sampling.
"""
