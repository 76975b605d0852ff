"""Prompt datasets: loading (JSONL / Parquet), rendering, resumable sampling, SFT examples."""

from gspo_megatron.data.dataset import PromptDataset, load_prompt_dataset, render_prompt
from gspo_megatron.data.records import BadRow, DataLoadError, LoadStats, PromptRecord
from gspo_megatron.data.sampler import PromptSampler, SamplerStats
from gspo_megatron.data.sft import SFTExample, build_sft_examples

__all__ = ["BadRow", "DataLoadError", "LoadStats", "PromptDataset", "PromptRecord",
           "PromptSampler", "SFTExample", "SamplerStats", "build_sft_examples",
           "load_prompt_dataset", "render_prompt"]
