"""One prompt's generation: its tokens so far, its text so far, and why it stopped.

A :class:`GenerationSequence` turns each chosen token into the text a client may see now:
the incremental detokenizer holds back an incomplete UTF-8 character, the stop-string
matcher holds back anything that could still become a stop string, and the end-of-sequence
ids, ``max_new_tokens`` and stop strings decide when the sequence is done.

Example::

    seq = GenerationSequence(0, prompt_ids, tokenizer, max_new_tokens=8,
                             eos_token_ids={2}, stop=("\\n\\n",))
    generation = seq.append(token_id)   # Generation(request_id=0, token_id=..., text=" Paris", ...)
"""

from __future__ import annotations

from typing import AbstractSet, Hashable, List, Optional, Sequence

from djl_stream.generation.detokenize import IncrementalDetokenizer
from djl_stream.generation.step import Generation
from djl_stream.generation.sampling import TokenChooser
from djl_stream.generation.stopping import StopStringMatcher

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
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = eos_token_ids
        self.chooser = chooser or TokenChooser()
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_ids)
        self.stop_matcher = StopStringMatcher(stop)
        # prompt + generated, kept only because processors such as the repetition
        # penalty read the whole sequence.
        self.all_ids: List[int] = list(self.prompt_ids) if self.chooser.needs_input_ids else []
        self.generated_ids: List[int] = []
        self.text = ""
        self.finish_reason: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> Generation:
        """Record the chosen token; return the text it releases and whether we are done."""
        if self.finished:
            raise RuntimeError(f"sequence {self.request_id!r} already finished")
        if token_id in self.eos_token_ids:
            # The end-of-sequence token is special: it adds no text, only releases what
            # the detokenizer and the stop matcher were holding back.
            text = self._finish("eos")
        else:
            self.generated_ids.append(token_id)
            if self.chooser.needs_input_ids:
                self.all_ids.append(token_id)
            text, stopped = self.stop_matcher.feed(self.detokenizer.step(token_id))
            if stopped:
                self.finish_reason = "stop"
            elif len(self.generated_ids) >= self.max_new_tokens:
                text += self._finish("length")
        self.text += text
        return Generation(self.request_id, token_id, text, self.finish_reason)

    def _finish(self, reason: str) -> str:
        text, stopped = self.stop_matcher.feed(self.detokenizer.finish())
        if stopped:
            self.finish_reason = "stop"
            return text
        self.finish_reason = reason
        return text + self.stop_matcher.flush()
