"""Incremental detokenization: the streamed pieces add up to what ``decode`` returns.

Two tokenizers: the real SmolLM2 one (ByteLevel BPE: emoji and CJK split into byte
tokens) and a SentencePiece-style one built here (Metaspace "▁" words, ``<0xHH>`` byte
fallback, like Llama and Mistral), each through the DecodeStream path and through the
prefix/offset path that tokenizers without a Rust backend take.
"""

from __future__ import annotations

import contextlib

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import djl_stream.generation.detokenize as detokenize_module
from djl_stream.generation.detokenize import PROMPT_CONTEXT, IncrementalDetokenizer

REPLACEMENT = "\ufffd"

#: Characters that exercise byte-level splitting: emoji (with skin tone and ZWJ),
#: CJK, accents, the "▁" SentencePiece uses itself, spaces and newlines.
CHARS = list("ab zé\n\t.,") + [
    "  ", "\n\n", "ñ", "ü", "中", "文", "你好", "，", "▁",
    "🙂", "🦩", "👋🏽", "👩‍💻", "🇫🇷", "Hello", " world",
]
CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming text token by token keeps every space.",
    "héllo wörld café naïve 你好 世界",
] * 8


def build_sentencepiece_like(decoder: str):
    """A BPE tokenizer shaped like Llama's: Metaspace words, 256 ``<0xHH>`` byte tokens
    for everything the vocab lacks (emoji, most CJK), specials ``<unk> <s> </s>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    metaspace = dict(replacement="▁", prepend_scheme="always")
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace)
    learner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = json.loads(learner.to_str())["model"]

    # Same layout as Llama: specials, then the byte tokens, then the learned pieces.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                     byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace)
    if decoder == "metaspace":
        tokenizer.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(**metaspace), decoders.Fuse()])
    else:  # what transformers' LlamaConverter writes
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.add_tokens([AddedToken("<tool>", special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


class PythonTokenizer:
    """A tokenizer without ``backend_tokenizer``, like transformers' Python ones: only
    ``decode`` and the id/token conversions, so the prefix/offset path is taken."""

    def __init__(self, fast) -> None:
        self._fast = fast
        self.all_special_ids = fast.all_special_ids

    def __len__(self) -> int:
        return len(self._fast)

    def decode(self, ids, skip_special_tokens=False) -> str:
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token):
        return self._fast.convert_tokens_to_ids(token)

    def convert_ids_to_tokens(self, token_id):
        return self._fast.convert_ids_to_tokens(token_id)


@pytest.fixture(scope="module", params=["metaspace", "llama"])
def sentencepiece_tokenizer(request):
    return build_sentencepiece_like(request.param)


@pytest.fixture(scope="module", params=["smollm2", "metaspace", "llama"])
def any_tokenizer(request, smollm2_tokenizer):
    if request.param == "smollm2":
        return smollm2_tokenizer
    return build_sentencepiece_like(request.param)


def byte_token_ids(tokenizer) -> list[int]:
    """Ids of the tokens that each stand for one byte."""
    vocab = tokenizer.get_vocab()
    fallback = [vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab]
    if fallback:
        return fallback
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # ByteLevel alphabet

    return [vocab[c] for c in bytes_to_unicode().values() if c in vocab]


# Built once per tokenizer (reading a 49k vocab per example would dominate the run);
# the tokenizer is kept in the value so its id cannot be reused by another one.
_strategies: dict[tuple[int, int], tuple[object, st.SearchStrategy[list[int]]]] = {}


def token_ids(tokenizer, max_size: int = 24) -> st.SearchStrategy[list[int]]:
    """Ids from the whole vocab, runs of single-byte tokens (mostly invalid UTF-8), and
    real encodings of emoji/CJK text with a few random ids spliced in."""
    key = (id(tokenizer), max_size)
    if key not in _strategies:
        _strategies[key] = (tokenizer, _token_ids(tokenizer, max_size))
    return _strategies[key][1]


def _token_ids(tokenizer, max_size: int) -> st.SearchStrategy[list[int]]:
    vocab_ids = st.integers(0, len(tokenizer) - 1)
    special = st.sampled_from(tokenizer.all_special_ids)
    byte_ids = st.sampled_from(byte_token_ids(tokenizer))

    @st.composite
    def encoded(draw) -> list[int]:
        text = "".join(draw(st.lists(st.sampled_from(CHARS), max_size=8)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(draw(st.integers(0, 2))):
            spliced = draw(st.one_of(vocab_ids, special, byte_ids))
            ids.insert(draw(st.integers(0, len(ids))), spliced)
        return ids

    return st.one_of(
        st.lists(vocab_ids, max_size=max_size),
        st.lists(st.one_of(byte_ids, byte_ids, special, vocab_ids), max_size=max_size),
        encoded(),
    )


def stream(tokenizer, ids, prompt_ids=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids,
                                   skip_special_tokens=skip_special_tokens)
    pieces = [detok.step(t) for t in ids]
    tail = detok.finish()
    assert detok.text == "".join(pieces) + tail
    return pieces, tail


def expected_text(tokenizer, ids, prompt_ids=(), skip_special_tokens=True) -> str:
    """The documented formula: the text of ``tail + ids`` after the part it shares with
    the text of ``tail`` alone (``tail``: the last PROMPT_CONTEXT prompt ids)."""
    tail = list(prompt_ids)[-PROMPT_CONTEXT:]
    full = tokenizer.decode(tail + list(ids), skip_special_tokens=skip_special_tokens)
    before = tokenizer.decode(tail, skip_special_tokens=skip_special_tokens) if tail else ""
    shared = 0
    while shared < min(len(full), len(before)) and full[shared] == before[shared]:
        shared += 1
    return full[shared:]


def assert_streams_exactly(tokenizer, reference, ids, prompt_ids=(), skip_special_tokens=True):
    pieces, tail = stream(tokenizer, ids, prompt_ids, skip_special_tokens)
    # The text is what decode gives, but for the U+FFFDs it would end with (bytes of a
    # character the sequence never completed): dropped.
    expected = expected_text(reference, ids, prompt_ids, skip_special_tokens).rstrip(REPLACEMENT)
    assert "".join(pieces) + tail == expected
    # Every piece is final: it sits at its place in the final text, so a U+FFFD in a
    # piece is one the final text has there too, never half a character.
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert expected.startswith(emitted), (pieces, expected)


# --- the invariants, over random sequences --------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_pieces_add_up_to_decode_without_prompt(any_tokenizer, data):
    ids = data.draw(token_ids(any_tokenizer))
    pieces, tail = stream(any_tokenizer, ids)
    decoded = any_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) + tail == decoded.rstrip(REPLACEMENT)
    assert_streams_exactly(any_tokenizer, any_tokenizer, ids)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_pieces_continue_the_prompt(any_tokenizer, data):
    prompt = data.draw(token_ids(any_tokenizer, max_size=12), label="prompt")
    ids = data.draw(token_ids(any_tokenizer), label="ids")
    assert_streams_exactly(any_tokenizer, any_tokenizer, ids, prompt)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_special_tokens_kept_when_asked(any_tokenizer, data):
    prompt = data.draw(st.one_of(st.just([]), token_ids(any_tokenizer, max_size=8)))
    ids = data.draw(token_ids(any_tokenizer))
    assert_streams_exactly(any_tokenizer, any_tokenizer, ids, prompt, skip_special_tokens=False)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_offset_fallback_obeys_the_same_invariants(any_tokenizer, data):
    prompt = data.draw(st.one_of(st.just([]), token_ids(any_tokenizer, max_size=12)))
    ids = data.draw(token_ids(any_tokenizer))
    slow = PythonTokenizer(any_tokenizer)
    assert_streams_exactly(slow, any_tokenizer, ids, prompt)


# Deliberate: only the image venvs of `make conformance` carry tokenizers < 0.22, where the
# prefix/offset window runs instead and there is no DecodeStream to make fail.
@pytest.mark.skipif(not detokenize_module.HAS_DECODE_STREAM,
                    reason="this tokenizers has no DecodeStream taking id lists (< 0.22): "
                           "the prefix/offset window runs instead")
@settings(max_examples=50, deadline=None)
@given(data=st.data(), failing_step=st.integers(1, 20))
def test_recovers_when_decode_stream_raises(any_tokenizer, data, failing_step):
    """DecodeStream can raise "Invalid prefix encountered"; the window restarts from the
    recent ids and the text stays exact."""
    prompt = data.draw(st.one_of(st.just([]), token_ids(any_tokenizer, max_size=8)))
    ids = data.draw(token_ids(any_tokenizer))
    with decode_stream_raising_at(failing_step):
        assert_streams_exactly(any_tokenizer, any_tokenizer, ids, prompt)


@pytest.mark.skipif(not detokenize_module.HAS_DECODE_STREAM,
                    reason="this tokenizers has no DecodeStream taking id lists (< 0.22)")
def test_a_restart_keeps_the_bytes_held_behind_skipped_special_tokens(smollm2_tokenizer):
    # Found by the test above: two lone continuation bytes ("¡", id 111), five skipped
    # special tokens, then the failing step. A restart from the last six ids lost the
    # first byte's U+FFFD ("!!!!�!" instead of "!!!!��!"): the context now holds every
    # id whose text was not out yet.
    ids = [17, 17, 17, 17, 111, 111, 1, 1, 1, 1, 1, 17]
    with decode_stream_raising_at(len(ids)):
        assert_streams_exactly(smollm2_tokenizer, smollm2_tokenizer, ids)


@contextlib.contextmanager
def decode_stream_raising_at(failing_step: int):
    """DecodeStream's ``step`` raises at its ``failing_step``-th call (over every stream
    made meanwhile), as tokenizers' own does on an invalid prefix."""
    real = detokenize_module.DecodeStream
    calls = {"n": 0}

    class FlakyDecodeStream:
        def __init__(self, *args, **kwargs):
            self._stream = real(*args, **kwargs)

        def step(self, tokenizer, ids):
            calls["n"] += 1
            if calls["n"] == failing_step:
                raise Exception("Invalid prefix encountered while decoding stream")
            return self._stream.step(tokenizer, ids)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(detokenize_module, "DecodeStream", FlakyDecodeStream)
        yield


# --- examples -----------------------------------------------------------------------


def test_decode_stream_is_used_exactly_where_it_takes_id_lists(smollm2_tokenizer):
    import inspect

    real = detokenize_module.DecodeStream
    takes_lists = real is not None and "ids" in inspect.signature(real).parameters
    window = IncrementalDetokenizer(smollm2_tokenizer)._window
    assert type(window).__name__ == ("_StreamWindow" if takes_lists else "_OffsetWindow")


def test_a_decode_stream_without_ids_is_not_used():
    class DecodeStreamOf021:  # tokenizers 0.21: DecodeStream(skip_special_tokens), one id a step
        def __init__(self, skip_special_tokens): ...

    assert not detokenize_module.streams_id_lists(DecodeStreamOf021)
    assert not detokenize_module.streams_id_lists(None)


def test_words_keep_their_spaces(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hello world")
    assert stream(smollm2_tokenizer, ids) == (["Hello", " world"], "")


def test_emoji_split_over_byte_tokens_comes_out_whole(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("🦩")
    assert len(ids) == 3  # one 4-byte character in three byte-level tokens
    assert stream(smollm2_tokenizer, ids) == (["", "", "🦩"], "")


def test_cjk_text_never_shows_half_characters(smollm2_tokenizer):
    text = "你好，世界！中文也可以。"
    pieces, tail = stream(smollm2_tokenizer, smollm2_tokenizer.encode(text))
    assert "".join(pieces) + tail == text
    assert "" in pieces  # some characters took more than one token
    assert not any(REPLACEMENT in piece for piece in pieces)


def test_a_sequence_ending_mid_character_drops_the_half_character(smollm2_tokenizer):
    # max_new_tokens can end a sequence between the tokens of one emoji: decode shows
    # U+FFFD for the bytes it has; the stream (and so the whole text) drops them.
    ids = smollm2_tokenizer.encode("ok 🦩")[:-1]
    assert smollm2_tokenizer.decode(ids) == "ok " + REPLACEMENT
    pieces, tail = stream(smollm2_tokenizer, ids)
    assert pieces[-1] == "" and REPLACEMENT not in "".join(pieces)
    assert "".join(pieces) + tail == "ok "


def test_eos_is_skipped(smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    ids = smollm2_tokenizer.encode("Hi there") + [eos]
    assert stream(smollm2_tokenizer, ids) == (["Hi", " there", ""], "")
    pieces, _ = stream(smollm2_tokenizer, ids, skip_special_tokens=False)
    assert pieces[-1] == "<|im_end|>"


def test_metaspace_first_token_keeps_its_space_after_a_prompt(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    (world,) = tok.encode("world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(world) == "▁world"
    prompt = tok.encode("Hello", add_special_tokens=False)
    assert stream(tok, [world], prompt_ids=prompt) == ([" world"], "")
    # Without a prompt the text starts there, and decode strips the leading space.
    assert stream(tok, [world]) == (["world"], "")


def test_byte_fallback_emoji_arrives_whole_with_the_next_token(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    ids = tok.encode("Hello 🙂 world", add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens.count("<0xF0>") == 1  # the emoji is four <0xHH> tokens
    pieces, tail = stream(tok, ids, prompt_ids=tok.encode("Say:", add_special_tokens=False))
    first_byte = tokens.index("<0xF0>")
    # A run of byte tokens is final only once a non-byte token ends it: one more byte
    # could turn the whole run into U+FFFDs (that is how ByteFallback decodes).
    assert pieces[first_byte:first_byte + 4] == ["", "", "", ""]
    assert "🙂" in pieces[first_byte + 4]
    assert "".join(pieces) + tail == " Hello 🙂 world"
    assert not any(REPLACEMENT in piece for piece in pieces)


def test_text_and_finish_after_finish(smollm2_tokenizer):
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    for token_id in smollm2_tokenizer.encode("a b"):
        detok.step(token_id)
    assert detok.finish() == "" and detok.finish() == ""
    assert detok.text == "a b" and detok.finished
    with pytest.raises(RuntimeError):
        detok.step(0)


def test_raw_tokenizers_tokenizer_is_accepted(smollm2_tokenizer):
    raw = smollm2_tokenizer.backend_tokenizer
    ids = raw.encode("Grüße 🦩").ids
    pieces, tail = stream(raw, ids)
    assert "".join(pieces) + tail == "Grüße 🦩"


def test_prompt_ids_may_be_a_tensor(smollm2_tokenizer):
    import torch

    prompt = torch.tensor(smollm2_tokenizer.encode("Say hi:"))
    ids = smollm2_tokenizer.encode(" 👋 hi")
    assert "".join(stream(smollm2_tokenizer, ids, prompt_ids=prompt)[0]) == " 👋 hi"
