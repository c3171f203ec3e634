"""A real forward hook that tilts a model's next-token logits toward one token.

The tiny random Llama almost never picks its end-of-sequence id on its own; tests that need
it to (``min_new_tokens``, ``ignore_eos``) add a bias to that id's logit in the output of
the model's ``lm_head``, for every forward pass or only for the next few. Every engine
(the Accelerate batch, the transformers-neuronx stand-in, ``generate()``) calls
``lm_head`` once per decode step, so "the next ``calls`` passes" means "the next
``calls`` tokens" for all of them.
"""

from __future__ import annotations

from typing import Optional


class LogitBias:
    """``with LogitBias(model, token_id=2, bias=5.0, calls=1): ...``"""

    def __init__(self, model, *, token_id: int, bias: float, calls: Optional[int] = None):
        self.model = model
        self.token_id = token_id
        self.bias = bias
        self.left = calls
        self._handle = None

    def _hook(self, module, args, output):
        if self.left is not None:
            if self.left <= 0:
                return output
            self.left -= 1
        output = output.clone()
        output[..., self.token_id] += self.bias
        return output

    def __enter__(self) -> "LogitBias":
        self._handle = self.model.lm_head.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
