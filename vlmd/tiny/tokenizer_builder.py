"""Deterministic little byte-level BPE tokenizers for tiny checkpoints.

The tokenizer is trained with the ``tokenizers`` library on a synthetic corpus generated in code
from ``seed`` (pseudo-words built from syllables with a Zipf-like frequency, plus a few English
words, numbers and punctuation), so no data is downloaded and the same seed always yields the
same ``tokenizer.json``.

Design points (shared by the LLaVA, Qwen2-VL and Whisper builders):

* Byte-level BPE (GPT-2 style ``ByteLevel`` pre-tokenizer and decoder) without the regex-free
  prefix space.
* Only the bytes ``\\t``, ``\\n`` and printable ASCII ``0x20-0x7e`` are in the alphabet.  The
  ``0x80-0xff`` bytes are left out on purpose: every token then decodes to complete, printable
  UTF-8 text, so a random model can never emit half a multi-byte character.  Text with other
  bytes encodes to ``unk_token`` (when given) or is dropped by the BPE model.
* ``leading_special_tokens`` get the first ids (``<unk> <s> </s>`` for Llama-like vocabularies);
  ``trailing_special_tokens`` are added after the trained vocabulary (``<image>``, ``<pad>`` for
  LLaVA, ``<|endoftext|>`` ... for Qwen2-VL / Whisper), like the published checkpoints do.
* Deterministic whatever the thread count: the BPE trainer counts pairs with rayon, but merge
  ties are broken by (count, pair ids), not by arrival order (checked: RAYON_NUM_THREADS=1, 2,
  3, 4 and PYTHONHASHSEED give byte-identical tokenizer.json).
* The post-processor is an explicit ``TemplateProcessing`` that adds nothing: encoding never
  inserts bos/eos by itself, whatever ``add_special_tokens`` says.  Chat templates must write the
  bos token themselves.  This keeps transformers 4.x, transformers 5.x and a plain
  ``tokenizers.Tokenizer.from_file("tokenizer.json")`` in agreement.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "ALLOWED_BYTES",
    "build_bpe_tokenizer",
    "byte_alphabet",
    "bytes_to_unicode",
    "synthetic_corpus",
]

#: Bytes kept in the byte-level alphabet: tab, newline and printable ASCII.
ALLOWED_BYTES: tuple[int, ...] = (0x09, 0x0A, *range(0x20, 0x7F))

_ONSETS = (
    "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
    "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "kn", "ph", "pl", "pr", "qu", "sc",
    "sh", "sk", "sl", "sm", "sn", "sp", "st", "str", "sw", "th", "tr", "tw", "wh", "wr",
)
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "au", "ea", "ee", "ei", "ie", "io", "oa", "oo", "ou", "ue")
_CODAS = (
    "", "", "", "b", "ck", "d", "ff", "g", "l", "ll", "m", "n", "nd", "ng", "nk", "nt", "p", "r",
    "rd", "rk", "rn", "rt", "s", "sh", "ss", "st", "t", "th", "x", "ze",
)
_ENGLISH = (
    "the of and to in is it that for on with as was at by this be from or are an which not have "
    "has but all can one what there when you your we they he she his her image picture photo "
    "shows show a an cat dog tree house car street sky blue red green white black small large "
    "left right top bottom center background people person man woman child color colour text "
    "describe question answer please yes no maybe because would could should about into over "
    "under between near far many few some every each other more less very well also then than"
).split()
_PUNCT_AFTER = (".", ".", ".", ",", ",", "?", "!", ":", ";")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char map (what ``ByteLevel`` uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_alphabet(allowed: Sequence[int] = ALLOWED_BYTES) -> list[str]:
    """The byte-level symbols of ``allowed`` bytes, in byte order."""
    table = bytes_to_unicode()
    return [table[b] for b in sorted(set(allowed))]


def _make_lexicon(rng: random.Random, n_words: int) -> list[str]:
    seen: set[str] = set()
    words: list[str] = []
    while len(words) < n_words:
        n_syl = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syl))
        if 2 <= len(w) <= 14 and w not in seen:
            seen.add(w)
            words.append(w)
    return words


def synthetic_corpus(
    seed: int,
    *,
    n_lines: int = 6000,
    n_words: int = 24000,
    extra_words: Sequence[str] = (),
) -> Iterator[str]:
    """Yield ``n_lines`` deterministic pseudo-English lines for tokenizer training.

    ``extra_words`` (e.g. chat-template keywords such as ``USER`` / ``ASSISTANT``) are sprinkled in
    often enough that BPE learns them as single or few tokens.
    """
    rng = random.Random(f"vlmd-tokenizer-corpus-{seed}")
    lexicon = list(_ENGLISH) + _make_lexicon(rng, n_words)
    # Zipf-ish weights: rank r gets 1/(r+8); a flat tail keeps rare words learnable.
    cum_weights: list[float] = []
    total = 0.0
    for r in range(len(lexicon)):
        total += 1.0 / (r + 8)
        cum_weights.append(total)
    extra = list(extra_words)
    for _ in range(n_lines):
        parts: list[str] = []
        for _s in range(rng.randint(1, 3)):
            sent = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(4, 16))
            if extra and rng.random() < 0.25:
                sent.insert(rng.randrange(len(sent) + 1), rng.choice(extra))
            if rng.random() < 0.15:
                sent.insert(rng.randrange(len(sent) + 1), str(rng.randint(0, 10 ** rng.randint(1, 5))))
            first = sent[0]
            sent[0] = first[:1].upper() + first[1:] if rng.random() < 0.8 else first
            parts.append(" ".join(sent) + rng.choice(_PUNCT_AFTER))
        sep = rng.choice((" ", " ", " ", "\n", "\t"))
        yield sep.join(parts)


def build_bpe_tokenizer(
    *,
    seed: int,
    vocab_size: int,
    leading_special_tokens: Sequence[str] = (),
    trailing_special_tokens: Sequence[str] = (),
    unk_token: str | None = None,
    extra_words: Sequence[str] = (),
    tokenizer_kwargs: Mapping[str, Any] | None = None,
    n_lines: int | None = None,
):
    """Train a byte-level BPE tokenizer and wrap it in a ``PreTrainedTokenizerFast``.

    Args:
        seed: corpus seed; the same seed (and arguments) gives a byte-identical tokenizer.json.
        vocab_size: total vocabulary size, trailing special tokens included.
        leading_special_tokens: special tokens given ids ``0..k-1`` (before the byte alphabet).
        trailing_special_tokens: special tokens appended after the trained vocabulary, in order.
        unk_token: token the BPE model maps unknown symbols to (must be one of the specials).
        extra_words: words to mix into the corpus (e.g. chat-template keywords).
        tokenizer_kwargs: forwarded to ``PreTrainedTokenizerFast`` (``bos_token``, ``eos_token``,
            ``pad_token``, ``unk_token``, ``model_max_length``, ...).
        n_lines: corpus size override (default scales with ``vocab_size``).

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with ``len(tok) == vocab_size``.
    """
    from transformers import PreTrainedTokenizerFast

    leading = list(leading_special_tokens)
    trailing = list(trailing_special_tokens)
    if len(set(leading + trailing)) != len(leading) + len(trailing):
        raise ValueError("special tokens must be unique")
    if unk_token is not None and unk_token not in leading + trailing:
        raise ValueError(f"unk_token {unk_token!r} must be one of the special tokens")
    base_size = vocab_size - len(trailing)
    alphabet = byte_alphabet()
    if base_size < len(leading) + len(alphabet) + 16:
        raise ValueError(f"vocab_size {vocab_size} is too small")

    tok = Tokenizer(models.BPE(unk_token=unk_token, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in leading],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        max_token_length=16,
    )
    if n_lines is None:
        n_lines = max(3000, base_size * 2)
    tok.train_from_iterator(synthetic_corpus(seed, n_lines=n_lines, extra_words=extra_words), trainer=trainer)
    if tok.get_vocab_size() != base_size:
        raise RuntimeError(
            f"BPE training reached {tok.get_vocab_size()} tokens, wanted {base_size}; enlarge the corpus (n_lines)"
        )
    # Training may not keep the BPE model's options; set them again.
    tok.model.unk_token = unk_token
    if trailing:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in trailing])
    # A post-processor that adds no special token (see module docstring).
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

    kwargs = dict(tokenizer_kwargs or {})
    kwargs.setdefault("add_bos_token", False)
    kwargs.setdefault("add_eos_token", False)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if len(hf_tok) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(hf_tok)} tokens, wanted {vocab_size}")
    return hf_tok
