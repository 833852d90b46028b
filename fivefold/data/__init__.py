"""Tokens in, batches out: the training data of a run.

- `sources`: tokenizers, the embedded corpus and raw text files, the layout-independent
  sampler (step k's global batch is a function of the seed and k) and micro-batches;
- `textfiles`: reading .txt/.jsonl with errors that name the file and line;
- `prepare` (`fivefold data prepare`) and `indexed`: tokenized memory-mapped shards;
- `packing` and `blend`: packed windows and Megatron-style blends over prepared data;
- `loader`: which of these a config asks for.
"""

from .._moved import moved_names

__getattr__ = moved_names(__name__, {name: "fivefold.data.sources" for name in (
    "CORPUS_DIR", "DataError", "Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "embedded_text",
    "load_text", "TokenData", "load_tokens", "Sampler", "micro_batches")})
