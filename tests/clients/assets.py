"""The assets torchtitan's debug configs expect and its wheel does not ship, generated on the spot.

``./tests/assets/tokenizer`` (a byte-level BPE ``tokenizer.json`` trained here with ``tokenizers``, vocab at
most the debug model's 2048, with ``<|begin_of_text|>`` / ``<|end_of_text|>`` and a ``tokenizer_config.json``
naming them) and ``./tests/assets/c4_test`` (a JSON-lines file of records with a ``"text"`` field, which
``datasets.load_dataset(path, split="train")`` reads). Deterministic: the same files on every call.

    python tests/clients/assets.py WORKDIR
"""
from __future__ import annotations

import json
import os
import random
import sys

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or had "
    "not but first one their its new after who they have has been also two other when all during into "
    "time year more would over city school state world between three later under most only where while "
    "river music family team season war game film group history church house party church village water "
    "station album series county became known called played built number since people part many against"
).split()


def _documents(n_docs: int, seed: int) -> list:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(rng.randint(8, 30)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 18))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def make_assets(workdir: str, vocab_size: int = 2048, n_docs: int = 400, seed: int = 0) -> None:
    """Write ``tests/assets/tokenizer`` and ``tests/assets/c4_test`` under ``workdir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = _documents(n_docs, seed)
    data_dir = os.path.join(workdir, "tests", "assets", "c4_test")
    tok_dir = os.path.join(workdir, "tests", "assets", "tokenizer")
    os.makedirs(data_dir, exist_ok=True)
    os.makedirs(tok_dir, exist_ok=True)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:00:00Z", "url": f"doc{i}"}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True,
                   "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}, f)


if __name__ == "__main__":
    make_assets(sys.argv[1])
    print("assets in", sys.argv[1])
