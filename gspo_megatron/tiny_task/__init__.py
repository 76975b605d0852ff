"""The tiny verifiable task of the CPU demo: a character tokenizer (``tokenizer.py``), an
addition dataset with an exact reward (``task.py``), a tiny random-init Qwen3-MoE
(``model.py``) and the writer of all of them (``assets.py``, used by
``tools/make_tiny_assets.py``).

Import from the submodules: this package's ``__init__`` stays empty so that looking up the
``tiny_addition`` reward (``task.py``) does not import transformers and torch.
"""
