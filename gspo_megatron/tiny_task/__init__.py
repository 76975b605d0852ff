"""The tiny verifiable task of the CPU demo: a character vocabulary (``vocab.py``) and tokenizer
(``tokenizer.py``), an addition dataset (``task.py``; its exact reward is ``tiny_addition`` in
``rewards/builtin.py``), the long-tail repeat dataset (``repeat_task.py``, reward ``tiny_repeat``),
a tiny random-init Qwen3-MoE (``model.py``) and the writer of all of them (``assets.py``, used by
``tools/make_tiny_assets.py``).

Import from the submodules: this package's ``__init__`` stays empty so that the reward, which
reads ``vocab.py``, does not import transformers and torch.
"""
