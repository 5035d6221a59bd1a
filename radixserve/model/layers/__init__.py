"""The shared pieces the model families are composed of (SGLang's and vLLM's ``layers/``).

``norm``: RMSNorm; ``rotary``: RoPE tables of every scaling type a supported checkpoint
uses; ``attention``: the attention block with its per-family options (q/k norms, biases,
partial rotary); ``mlp``: the SiLU-gated MLP; ``decoder``: the decoder layers (pre-norm as
Llama, post-norm as OLMo 2). A family (``model/families/``) picks among them from its
config; the causal LM that runs them is ``model/llama.py``'s.
"""
