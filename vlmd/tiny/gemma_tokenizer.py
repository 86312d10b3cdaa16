"""A little Gemma-style tokenizer for the tiny checkpoints, trained offline and deterministic
(Gemma 3's and Gemma 4's: the same construction, each family's special tokens).

Built like the published Gemma 3 tokenizer is (transformers' ``GemmaTokenizer`` /
``GemmaConverter``), so servers that read Gemma's vocabulary load it as they load the real
one (vLLM's Gemma 3 processor looks up ``vocab["\\n"]`` ... ``vocab["\\n\\n\\n\\n"]`` and the
image tokens):

* SentencePiece-style BPE with byte fallback: a character the vocabulary lacks is written as
  its UTF-8 bytes ``<0x00>`` ... ``<0xFF>``, never ``<unk>``, so any text round-trips and a
  model can emit half a multi-byte character (the detokenizer must wait for the rest).
* Spaces become "▁" in a ``Replace`` normalizer; the pre-tokenizer is Gemma's
  ``Split(" ", merged_with_previous)`` (a no-op once spaces are "▁": BPE sees the whole text
  between special tokens); the decoder is ``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``.
* ``\\n``, ``\\n\\n``, ``\\n\\n\\n`` and ``\\n\\n\\n\\n`` are vocabulary entries, the longer ones
  reached by merges, so a run of up to four newlines is one token, and newlines merge with
  nothing else (merges were learned on text cut at newlines, digits, punctuation and before
  "▁", as SentencePiece's splitting options cut Gemma's training text).
* The ids are laid out as Gemma's: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3,
  ``<mask>`` 4, the family's turn and media-boundary tokens (``leading_special``), the
  newline runs and tab, the 256 byte tokens, the learned pieces, and the media soft tokens
  last (``trailing_special``; Gemma 3's ``<image_soft_token>``).
* Encoding adds no bos/eos by itself (the chat template writes ``<bos>``), as every tiny
  builder's tokenizer (``vlmd.tiny.tokenizer_builder``).

The pieces are learned by the ``tokenizers`` BPE trainer on ``synthetic_corpus(seed)``;
the same seed gives the same ``tokenizer.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from vlmd.tiny.tokenizer_builder import synthetic_corpus

__all__ = ["BYTE_TOKENS", "CORE_SPECIAL_TOKENS", "LEADING_SPECIAL_TOKENS", "NEWLINE_RUNS", "TRAILING_SPECIAL_TOKENS",
           "build_gemma_tokenizer"]

CORE_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
# Gemma 3's (the defaults).
LEADING_SPECIAL_TOKENS = (*CORE_SPECIAL_TOKENS, "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                          "<end_of_image>")
TRAILING_SPECIAL_TOKENS = ("<image_soft_token>",)
# vLLM's Gemma 3 processor joins "\n" + "\n\n" into "\n\n\n" and "\n\n" + "\n\n" into "\n\n\n\n"
# around an image, as this tokenizer encodes them: the four must be single tokens.
NEWLINE_RUNS = tuple("\n" * length for length in range(1, 5))
NEWLINE_MERGES = (("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n"))
BYTE_TOKENS = tuple(f"<0x{value:02X}>" for value in range(256))
SPACE = "▁"
# The characters pieces are learned from (the corpus is ASCII; anything else falls back to bytes).
ALPHABET = (SPACE, *(chr(code) for code in range(0x21, 0x7F)))
# How the training text is cut (what a learned piece never spans): a word with the spaces
# before it, a punctuation run with the spaces before it, one digit (Gemma splits digits),
# a run of spaces, one newline or tab.
_TRAINING_CHUNKS = Regex(rf"{SPACE}*[A-Za-z]+|{SPACE}*[^A-Za-z0-9{SPACE}\n\t]+|[0-9]|{SPACE}+|\n|\t")


def _learned_pieces(seed: int, size: int, extra_words: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """``size`` pieces (the alphabet first, then each merge's result, in merge order) and the merges."""
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Split(_TRAINING_CHUNKS, behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=size, min_frequency=2, show_progress=False, initial_alphabet=list(ALPHABET),
                                  limit_alphabet=len(ALPHABET), max_token_length=16)
    # Newlines and tabs are cut out as their own chunks; they are placed by the caller, not learned.
    corpus = (line.replace("\n", " ").replace("\t", " ") for line in
              synthetic_corpus(seed, n_lines=max(3000, size * 2), extra_words=extra_words))
    trainer_tokenizer.train_from_iterator(corpus, trainer=trainer)
    vocab = trainer_tokenizer.get_vocab()
    if len(vocab) != size:
        raise RuntimeError(f"BPE training reached {len(vocab)} pieces, wanted {size}; enlarge the corpus")
    pieces = sorted(vocab, key=vocab.__getitem__)
    merges = [tuple(merge) for merge in _trained_merges(trainer_tokenizer)]
    if pieces[:len(ALPHABET)] != sorted(ALPHABET, key=vocab.__getitem__) or len(merges) != size - len(ALPHABET):
        raise RuntimeError("unexpected BPE training result: the alphabet first, then one piece per merge")
    return pieces, merges


def _trained_merges(tokenizer: Tokenizer) -> list[list[str]]:
    # The trained model's merges are only readable from its serialised form.
    return [merge.split(" ", 1) if isinstance(merge, str) else merge
            for merge in json.loads(tokenizer.to_str())["model"]["merges"]]


def build_gemma_tokenizer(
    *,
    seed: int,
    vocab_size: int,
    extra_words: Sequence[str] = (),
    tokenizer_kwargs: Mapping[str, Any] | None = None,
    leading_special: Sequence[str] = LEADING_SPECIAL_TOKENS,
    trailing_special: Sequence[str] = TRAILING_SPECIAL_TOKENS,
):
    """A Gemma-style tokenizer of exactly ``vocab_size`` tokens, as a ``PreTrainedTokenizerFast``.

    Args:
        seed: corpus seed; the same seed (and arguments) gives a byte-identical tokenizer.json.
        vocab_size: total vocabulary size, special, newline and byte tokens included.
        extra_words: words mixed into the corpus (chat-template words) so they get few tokens.
        tokenizer_kwargs: forwarded to ``PreTrainedTokenizerFast`` (special tokens' roles,
            ``chat_template``, ...).
        leading_special: special tokens at ids 0.. (``CORE_SPECIAL_TOKENS`` first, as Gemma's).
        trailing_special: special tokens after the learned pieces.
    """
    from transformers import PreTrainedTokenizerFast

    fixed = [*leading_special, *NEWLINE_RUNS, "\t", *BYTE_TOKENS]
    learned_size = vocab_size - len(fixed) - len(trailing_special)
    if learned_size < len(ALPHABET) + 64:
        raise ValueError(f"vocab_size {vocab_size} is too small (at least {len(fixed) + len(ALPHABET) + 65})")
    pieces, learned_merges = _learned_pieces(seed, learned_size, extra_words)
    ordered = [*fixed, *pieces, *trailing_special]
    if len(set(ordered)) != len(ordered):
        raise RuntimeError("a learned piece repeats a fixed token")
    vocab = {token: index for index, token in enumerate(ordered)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[*NEWLINE_MERGES, *learned_merges], unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    # Already in the vocabulary: registering them keeps their ids and makes them split the text.
    tok.add_special_tokens([AddedToken(token, special=True, normalized=False)
                            for token in (*leading_special, *trailing_special)])
    # A post-processor that adds nothing: the chat template writes <bos> (module docstring).
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

    kwargs = dict(tokenizer_kwargs or {})
    kwargs.setdefault("add_bos_token", False)
    kwargs.setdefault("add_eos_token", False)
    kwargs.setdefault("unk_token", "<unk>")
    kwargs.setdefault("mask_token", "<mask>")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if len(hf_tok) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(hf_tok)} tokens, wanted {vocab_size}")
    return hf_tok
