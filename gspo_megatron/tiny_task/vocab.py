"""The tiny task's character vocabulary (no heavy imports, so the reward can use it cheaply)."""

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
# Digits and operators of the task, a space, and the letters of the optional "Q: ... A:" framing.
ALPHABET = "0123456789+-*= \nQA:"
# Free text for rollout tests and benchmarks (prompts such as "what is 1+1?"): see model.py.
TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=?."
