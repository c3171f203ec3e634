"""Stand-in for transformers-neuronx implementing its documented interface for contract
tests; not the real package.

It runs a real Hugging Face torch model on the CPU (so the tokens are real) behind the
interface djl-stream's "transformers-neuronx" engine relies on, and checks what the real
library requires of its callers:

- ``NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=, tp_degree=, amp=,
  n_positions=, context_length_estimate=)`` returns a ``*ForSampling``-style model (the
  keyword arguments are recorded; the computation stays float32 whatever ``amp`` says);
- ``load(dir)`` before ``to_neuron()`` makes ``to_neuron()`` read the saved graphs (missing
  or mismatched ones raise ``FileNotFoundError``, as the library does); ``save(dir)`` after
  ``to_neuron()`` writes them as ``*.neff`` files. Every call is recorded in ``calls``;
- compiling (``to_neuron()`` without loaded graphs) writes a work file into the current
  directory, as the Neuron compiler does, so it fails in a read-only one; the directory it
  ran in is recorded in ``compile_cwd``;
- ``sample(input_ids, sequence_length, start_ids=None, top_k=50, top_p=1.0,
  eos_token_override=None, temperature=1.0, streamer=None)`` refuses a batch other than
  the compiled one, a ``sequence_length`` (prompt + new tokens) beyond ``n_positions`` and
  ``top_p`` / ``temperature`` that are not Python floats; it treats ``start_ids[i]`` as
  where row ``i``'s real tokens begin in a left-padded batch (the padding is masked out and
  positions count from there), calls ``streamer.put()`` once per step with a ``(batch, 1)``
  tensor (never the prompt), marks a row done when its token equals the eos id (the
  config's first ``eos_token_id``, or ``eos_token_override`` when given, as the Llama
  family's ``sample()`` does) and feeds that id to rows that are done, stops when every row
  is done or at ``sequence_length``, and calls ``streamer.end()``.

The real library is not on PyPI and needs Neuron hardware; nothing here is its code.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch

from djl_stream.runtime.forward_kwargs import cache_in as cache_of, cache_kwarg

__version__ = "0.0+standin"
GRAPH_FILE = "standin-graph.neff"
COMPILER_WORK_FILE = "standin-neuronx-cc.log"


class StandInForSampling:
    """A compiled-for-Neuron causal LM, played by a torch model on the CPU."""

    def __init__(self, hf_model, *, n_positions: int = 2048, batch_size: int = 1,
                 amp: str = "f32", tp_degree: int = 2, context_length_estimate=None,
                 **kwargs: Any) -> None:
        self.hf_model = hf_model.eval()
        self.compile_settings = dict(n_positions=n_positions, batch_size=batch_size, amp=amp,
                                     tp_degree=tp_degree,
                                     context_length_estimate=context_length_estimate, **kwargs)
        # As in the library, the neuron config carries the Hugging Face config's fields
        # plus the compiled shapes.
        self.config = SimpleNamespace(**{**hf_model.config.to_dict(), "n_positions": n_positions,
                                         "batch_size": batch_size, "amp": amp,
                                         "tp_degree": tp_degree})
        self.calls: List[tuple] = []
        self.sample_calls: List[Dict[str, Any]] = []
        self.steps_streamed = 0
        self.last_result: Optional[torch.Tensor] = None
        self._artifacts: Optional[str] = None
        self._on_device = False
        self.compile_cwd: Optional[str] = None

    # -- compiling --------------------------------------------------------------------

    def load(self, directory: str) -> None:
        self.calls.append(("load", directory))
        self._artifacts = directory

    def to_neuron(self) -> None:
        self.calls.append(("to_neuron",))
        if self._artifacts is not None:
            path = os.path.join(self._artifacts, GRAPH_FILE)
            try:
                with open(path) as f:
                    saved = json.load(f)
            except FileNotFoundError:
                raise FileNotFoundError("Could not find a matching NEFF for your HLO in this "
                                        "directory.") from None
            if saved != self.compile_settings:
                raise FileNotFoundError("Could not find a matching NEFF for your HLO in this "
                                        "directory.")
        else:
            self.compile_cwd = os.getcwd()
            with open(COMPILER_WORK_FILE, "a") as f:  # relative: the current directory
                f.write(json.dumps(self.compile_settings) + "\n")
        self._on_device = True

    def save(self, directory: str) -> None:
        if not self._on_device:
            raise AssertionError("cannot save a model which has not been successfully compiled")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, GRAPH_FILE), "w") as f:
            json.dump(self.compile_settings, f)
        self.calls.append(("save", directory))

    # -- generating -------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, input_ids, sequence_length, start_ids=None, top_k=50, top_p=1.0,
               eos_token_override=None, temperature=1.0, streamer=None):
        batch_size, width = input_ids.shape
        settings = self.compile_settings
        self.sample_calls.append(dict(input_ids=input_ids.clone(), sequence_length=sequence_length,
                                      start_ids=None if start_ids is None else start_ids.clone(),
                                      top_k=top_k, top_p=top_p, temperature=temperature,
                                      eos_token_override=eos_token_override))
        if not self._on_device:
            raise RuntimeError("call to_neuron() before sample()")
        if batch_size != settings["batch_size"]:
            raise ValueError(f"Model not compiled for batch_size : {batch_size}. Acceptable "
                             f"batch_size is one of the following [{settings['batch_size']}]")
        if sequence_length > settings["n_positions"]:
            raise ValueError(f"sequence_length {sequence_length} is beyond n_positions "
                             f"{settings['n_positions']}")
        if type(top_p) is not float or not 0.0 < top_p <= 1.0:
            raise ValueError("top_p has to be a strictly positive float that less than or equal to 1.0.")
        if type(temperature) is not float or not temperature > 0:
            raise ValueError("temperature has to be a strictly positive float.")
        if not isinstance(top_k, int) or top_k <= 0:
            raise ValueError("top_k has to be a strictly positive int.")

        if start_ids is None:
            start_ids = torch.zeros(batch_size, dtype=torch.int32)
        columns = torch.arange(width)
        mask = (columns[None, :] >= start_ids[:, None].long()).long()
        positions = (columns[None, :] - start_ids[:, None].long()).clamp(min=0)
        out = self.hf_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            use_cache=True)
        eos = self.config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        if eos_token_override is not None:
            eos = eos_token_override
        done = torch.zeros((batch_size, 1), dtype=torch.bool)
        tokens = [input_ids]
        for current in range(width, sequence_length):
            chosen = self._choose(out.logits[:, -1, :].float(), top_k, top_p, temperature)
            done |= chosen == eos
            chosen = torch.where(done, torch.full_like(chosen, eos), chosen)
            tokens.append(chosen)
            if streamer is not None:
                streamer.put(chosen)
                self.steps_streamed += 1
            if current + 1 >= sequence_length or bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((batch_size, 1), dtype=mask.dtype)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.hf_model(input_ids=chosen, attention_mask=mask, position_ids=positions,
                                use_cache=True, **cache_kwarg(self.hf_model, cache_of(out)))
        if streamer is not None:
            streamer.end()
        self.last_result = torch.cat(tokens, dim=-1)
        return self.last_result

    @staticmethod
    def _choose(scores: torch.Tensor, top_k: int, top_p: float, temperature: float) -> torch.Tensor:
        if top_k == 1:
            return scores.argmax(dim=-1, keepdim=True)
        values, indices = torch.topk(scores / temperature, min(top_k, scores.shape[-1]))
        probs = torch.softmax(values, dim=-1)
        if top_p < 1.0:
            keep = probs.cumsum(dim=-1) - probs < top_p  # always keeps the most likely
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        return indices.gather(1, torch.multinomial(probs, num_samples=1))


class NeuronAutoModelForCausalLM:
    """``from_pretrained`` as in the library: the checkpoint's config picks the class.
    Every model made is kept in ``instances`` for tests to inspect."""

    instances: List[StandInForSampling] = []

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from transformers import AutoModelForCausalLM, PretrainedConfig

        # transformers before 4.56 calls the keyword torch_dtype (and has no config.dtype).
        keyword = "dtype" if hasattr(PretrainedConfig, "dtype") else "torch_dtype"
        hf_model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path,
                                                        **{keyword: torch.float32})
        model = StandInForSampling(hf_model, *model_args, **kwargs)
        model.from_pretrained_call = (pretrained_model_name_or_path, dict(kwargs))
        cls.instances.append(model)
        return model


LlamaForSampling = StandInForSampling
