"""One prompt's generation: its tokens so far, its text so far, and why it stopped.

A :class:`GenerationSequence` turns each chosen token into the text a client may see now:
the incremental detokenizer holds back an incomplete UTF-8 character, the stop-string
matcher holds back anything that could still become a stop string, and the end-of-sequence
ids, ``max_new_tokens`` and stop strings decide when the sequence is done. With
``ignore_eos`` the end-of-sequence ids do not end it (generation runs on to
``max_new_tokens`` or a stop string); they still add no text.

Example::

    seq = GenerationSequence(0, prompt_ids, tokenizer, max_new_tokens=8,
                             eos_token_ids={2}, stop=("\\n\\n",))
    generation = seq.append(token_id)   # Generation(request_id=0, token_id=..., text=" Paris", ...)
"""

from __future__ import annotations

import weakref
from typing import AbstractSet, Any, FrozenSet, Hashable, List, Optional, Sequence, Tuple

from djl_stream.generation.detokenize import IncrementalDetokenizer
from djl_stream.generation.step import Generation
from djl_stream.generation.sampling import TokenChooser
from djl_stream.generation.stopping import StopStringMatcher

_SPECIAL_IDS: "weakref.WeakKeyDictionary[Any, FrozenSet[int]]" = weakref.WeakKeyDictionary()


def special_token_ids(tokenizer: Any) -> FrozenSet[int]:
    """The ids a tokenizer calls special: its named special tokens (``all_special_ids``:
    bos, eos, pad, unk, ...) and every added token flagged special, which is what
    ``decode(..., skip_special_tokens=True)`` drops, so none of them adds text.

    Works for transformers tokenizers and raw ``tokenizers.Tokenizer`` objects; anything
    else has none. Computed once per tokenizer.

    >>> sorted(special_token_ids(tokenizer))[:3]   # doctest: +SKIP
    [0, 1, 2]
    """
    try:
        return _SPECIAL_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added is None:
        backend = tokenizer if hasattr(tokenizer, "get_added_tokens_decoder") else getattr(
            tokenizer, "backend_tokenizer", None)
        getter = getattr(backend, "get_added_tokens_decoder", None)
        added = getter() if callable(getter) else {}
    ids.update(int(i) for i, token in dict(added).items() if getattr(token, "special", False))
    found = frozenset(ids)
    try:
        _SPECIAL_IDS[tokenizer] = found
    except TypeError:  # not weak-referenceable: compute every time
        pass
    return found


class GenerationSequence:
    """State of one prompt being generated; see the module docstring."""

    def __init__(
        self,
        request_id: Hashable,
        prompt_ids: Sequence[int],
        tokenizer,
        *,
        max_new_tokens: int,
        eos_token_ids: AbstractSet[int],
        stop: Sequence[str] = (),
        chooser: Optional[TokenChooser] = None,
        ignore_eos: bool = False,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = eos_token_ids
        self.ignore_eos = bool(ignore_eos)
        self.chooser = chooser or TokenChooser()
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_ids)
        self.stop_matcher = StopStringMatcher(stop)
        self.special_ids = special_token_ids(tokenizer)
        # prompt + generated, kept only while processors such as the repetition penalty
        # or min_new_tokens read the whole sequence.
        self.all_ids: List[int] = list(self.prompt_ids) if self.chooser.needs_input_ids else []
        self.generated_ids: List[int] = []
        self.text = ""
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def fail(self, error: BaseException) -> Generation:
        """End the sequence because choosing its token failed; the :class:`Generation`
        carries the error and no text (what was held back is never released)."""
        self.error = f"{type(error).__name__}: {error}"
        return Generation(self.request_id, -1, "", error=self.error)

    def append(
        self,
        token_id: int,
        logprob: Optional[float] = None,
        top_logprobs: Tuple[Tuple[int, float], ...] = (),
    ) -> Generation:
        """Record the chosen token; return the text it releases and whether we are done.

        ``logprob`` and ``top_logprobs`` (from :func:`~djl_stream.generation.sampling.token_logprobs`)
        are passed through to the :class:`Generation`.
        """
        if self.finished:
            raise RuntimeError(f"sequence {self.request_id!r} already finished")
        self.chooser.note_token(token_id)
        eos = token_id in self.eos_token_ids
        if eos and not self.ignore_eos:
            # The end-of-sequence token is special: it adds no text, only releases what
            # the detokenizer and the stop matcher were holding back.
            text = self._finish("eos")
        else:
            self.generated_ids.append(token_id)
            if self.chooser.needs_input_ids:
                self.all_ids.append(token_id)
            self.chooser.note_generated(len(self.generated_ids))
            # An eos id that does not end the sequence is still not text, even where the
            # tokenizer does not flag it special.
            piece = "" if eos else self.detokenizer.step(token_id)
            text, stopped = self.stop_matcher.feed(piece)
            if stopped:
                self.finish_reason = "stop"
            elif len(self.generated_ids) >= self.max_new_tokens:
                text += self._finish("length")
        self.text += text
        return Generation(self.request_id, token_id, text, self.finish_reason,
                          logprob=logprob, top_logprobs=tuple(top_logprobs),
                          special=eos or token_id in self.special_ids)

    def end(self, token_id: int, reason: str = "eos") -> Generation:
        """End the sequence from outside, as if ``token_id`` had ended it for ``reason``
        (an engine whose own sampler stopped the row), releasing the text held back."""
        if self.finished:
            raise RuntimeError(f"sequence {self.request_id!r} already finished")
        text = self._finish(reason)
        self.text += text
        return Generation(self.request_id, token_id, text, self.finish_reason,
                          special=token_id in self.eos_token_ids or token_id in self.special_ids)

    def _finish(self, reason: str) -> str:
        text, stopped = self.stop_matcher.feed(self.detokenizer.finish())
        if stopped:
            self.finish_reason = "stop"
            return text
        self.finish_reason = reason
        return text + self.stop_matcher.flush()
