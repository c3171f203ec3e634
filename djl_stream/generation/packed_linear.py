"""Linear layers whose weights oneDNN has prepacked for this CPU.

On a CPU, a decode step is a chain of matrix-vector products that stream every weight
once, so its speed is the speed at which those products read memory. PyTorch's
``nn.Linear`` on a CPU hands a few-row input to MKL's GEMM in the weight's own
``(out, in)`` layout; on the 2-core AMD EPYC this project is measured on, the matrix
products of one SmolLM2-135M decode step read their 538 MB at 11-12 GB/s with one row and
worse with a few (8 GB/s with 4), while the machine streams 35 GB/s. oneDNN, which ships
inside PyTorch, reorders a weight once into the blocked layout its kernels read fastest
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplies with it
(``torch.ops.mkldnn._linear_pointwise``): the same products at 14-19 GB/s. Measured on
that machine, the 211 matrix products of a SmolLM2 step (``python -m
benchmarks.linear_packing``):

=========  ==============  ================
rows       ``nn.Linear``   prepacked
=========  ==============  ================
1          47 ms           29 ms
4          66 ms           28 ms
16         73 ms           39 ms
=========  ==============  ================

Not on every CPU: on a 2-core Intel Xeon (480 MB of L3 cache) MKL read a plain weight
with one row at 24 GB/s, packed ones at 16.5 GB/s, and packing gained 6-11% from four
rows. So where ``option.prepack_weights`` is unset the load times one row through every
layer both ways (:func:`packing_trial`) and keeps the layers unpacked where packing makes
it :data:`SLOWER_AT_ONE_ROW` times slower or worse (``pack_linear_layers(model,
only_where_it_pays=True)``). Where a compiled program runs the one-row steps
(:mod:`~djl_stream.generation.compiled_decode`: with its own copy of the weights, or
reading the model's plain weights, which packing then copies), the layers serve batches
and prompts only, and the trial times :data:`BATCH_HINT` rows instead (``trial_rows``;
beside the plain weights, packing must be ``speedup_wanted`` times faster).

This is what TorchInductor's ``freezing`` does to a compiled CPU graph (in bf16) and what
Intel's extension for PyTorch did as ``ipex.optimize``; here it is done once at load, in
eager mode, through the two operators PyTorch registers for it. The results are those of
another GEMM (sums in another order: within 1e-4 of ``nn.Linear``'s for SmolLM2's
logits, the same greedy text); :func:`pack_linear_layers` checks every layer it packs
against ``nn.Linear`` on a probe and leaves the model alone if one differs (or stops
there, past the first :data:`TRIAL_BYTES` of weights: layers are packed one at a time,
each put in place before the next is packed, so that a model's weights are not held
twice at load).

bfloat16 weights are packed too where the CPU multiplies bfloat16 natively
(:func:`bfloat16_native`): the products then read half the bytes at about the same rate
(a one-row SmolLM2 step's products: 15 ms against float32's 30, on AVX512-BF16).

A tied output embedding (SmolLM2's LM head shares the input embedding's weight) is packed
as a copy: the embedding still reads the original rows. That costs the embedding's size
again in memory (113 MB for SmolLM2) and saves about 5 ms a token (the LM head alone read
at 12 GB/s took 9.4 ms).

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(64, 32)
    >>> packed = PackedLinear.from_linear(layer)
    >>> x = torch.randn(3, 64)
    >>> bool(torch.allclose(packed(x), layer(x), atol=1e-5)) if packed else True
    True
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

#: The batch size oneDNN is told to expect when it chooses the weight's layout. Measured
#: on SmolLM2's shapes (2-core EPYC): a layout chosen for 4 or 16 rows serves 1 to 32
#: rows within 5% of the best for each, one chosen for 1 row is 10-40% slower above 1.
BATCH_HINT = 16
#: With ``option.prepack_weights`` unset, layers are left unpacked where packing makes
#: one row's products this many times slower or worse. Packing was worth it on the AMD
#: EPYC this module was first measured on (one row 1.6x faster, 16 rows 1.9x); on a 2-core
#: Intel Xeon with a 480 MB L3 cache, plain ``nn.Linear`` read one row's weights at
#: 24 GB/s against 16.5 packed (a one-row decode step 29 against 37 ms) while packing
#: gained 6-11% at 4 and 16 rows. One row is the case that decides: a single stream, the
#: commonest on a laptop, and the largest difference either way.
SLOWER_AT_ONE_ROW = 1.10
#: The trial times the first layers whose weights add up to this much (a smaller model's
#: all): enough to read them from memory rather than from a cache (the Xeon's L3 is
#: 480 MB), while the packed copies held beside the plain weights during the trial stay
#: bounded. A model's weights are never held twice whole: float32 weights loaded from a
#: bfloat16 checkpoint are memory of their own, and a 3B model's 12 GB twice over would
#: not fit a 16 GB machine.
TRIAL_BYTES = 1 << 30
#: How far a packed layer's output may be from ``nn.Linear``'s on the probe, relative to
#: the largest output, by weight dtype (another summation order: ~1e-6 in float32; in
#: bfloat16 the outputs themselves are rounded to 8 bits of mantissa, 4e-3 apart).
#: :func:`agrees_on_probe` holds any other kernel of a linear layer to it too.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 3e-2}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def bfloat16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), where oneDNN's
    packed bfloat16 products read half the bytes of float32's at about the same rate.
    Elsewhere oneDNN emulates them, and bfloat16 weights are left as they are."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def packing_unavailable() -> Optional[str]:
    """Why linear layers cannot be prepacked in this PyTorch, or ``None`` if they can.

    >>> packing_unavailable() is None or isinstance(packing_unavailable(), str)
    True
    """
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch was built without oneDNN (mkldnn)"
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(torch.ops.mkldnn, name):
            return f"this PyTorch has no torch.ops.mkldnn.{name}"
    return None


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward over a weight oneDNN has reordered for this CPU.

    The packed weight is a parameter (``weight``, an opaque oneDNN tensor: its shape,
    dtype and size are the original's, its storage cannot be read), so that a count of the
    model's parameters or of their bytes stays true. Where the original weight lives on
    (tied to an input embedding), the packed one is a copy and says so:
    ``weight.duplicates_a_weight`` is ``True`` (a count of the model's own weights skips it).
    """

    def __init__(self, packed_weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.out_features, self.in_features = packed_weight.shape
        self.weight = torch.nn.Parameter(packed_weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(),
                                                                requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear,
                    batch_hint: int = BATCH_HINT) -> Optional["PackedLinear"]:
        """The packed twin of ``linear``, or ``None`` where it cannot be packed (not a
        plain float32 CPU weight, say a quantized one, or no oneDNN in this PyTorch; a
        bfloat16 weight is packed where this CPU multiplies bfloat16 natively)."""
        weight = linear.weight
        if (packing_unavailable() is not None or type(weight) not in _PLAIN_TENSORS
                or weight.device.type != "cpu" or weight.dim() != 2
                or not (weight.dtype == torch.float32
                        or (weight.dtype == torch.bfloat16 and bfloat16_native()))):
            return None  # a quantized weight is a tensor subclass: its own kernels read it
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                            batch_size=batch_hint)
        return cls(packed, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, prepacked by oneDNN")


def agrees_on_probe(reference, candidate, in_features: int, dtype: torch.dtype,
                    rows: int = 3) -> bool:
    """Whether ``candidate`` (another way of running a linear layer) gives what
    ``reference`` gives on ``rows`` random rows of ``dtype``: finite, and within
    :data:`TOLERANCE` of the largest output.

    >>> layer = torch.nn.Linear(8, 4)
    >>> agrees_on_probe(layer, layer, 8, torch.float32), agrees_on_probe(
    ...     layer, lambda x: layer(x) + 1, 8, torch.float32)
    (True, False)
    """
    probe = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        expected = reference(probe).float()
        got = candidate(probe).float()
    scale = float(expected.abs().max()) or 1.0
    tolerance = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    return (bool(torch.isfinite(got).all())
            and float((got - expected).abs().max()) <= tolerance * scale)


@dataclasses.dataclass(frozen=True)
class PackingTrial:
    """``rows`` rows through every layer to be packed, with ``nn.Linear`` and packed: the
    sum of each layer's fastest call, each way (:func:`packing_trial`)."""

    plain_seconds: float
    packed_seconds: float
    rows: int = 1

    @property
    def pays(self) -> bool:
        """Whether packing is worth it: unless it makes one row's products
        :data:`SLOWER_AT_ONE_ROW` times slower or worse (a margin well beyond the
        trial's noise, so that a model is not packed at one start and not at the next)."""
        return self.packed_seconds < self.plain_seconds * SLOWER_AT_ONE_ROW

    @property
    def speedup(self) -> float:
        """How many times faster the packed layers were (under 1: slower)."""
        return self.plain_seconds / self.packed_seconds if self.packed_seconds else math.inf

    def __str__(self) -> str:
        rows = "one row" if self.rows == 1 else f"{self.rows} rows"
        return (f"{rows} through the layers: {self.plain_seconds * 1e3:.1f} ms with "
                f"nn.Linear, {self.packed_seconds * 1e3:.1f} ms packed")


def packing_trial(pairs, repetitions: int = 7,
                  clock: Callable[[], float] = time.perf_counter, rows: int = 1) -> PackingTrial:
    """Time ``rows`` rows through each ``(nn.Linear, PackedLinear)`` of ``pairs``, all the
    plain layers then all the packed ones, ``repetitions`` times in turns (after one
    untimed pass each), and sum each layer's fastest time, each way: another process on
    the same cores (a second worker loading beside this one, say) only ever slows a call,
    and it slows some calls of a round, not whole rounds: two servers loading together on
    the 2-core machine timed rounds 10-40 times their usual length in no stable order, and
    with eleven loading at once (``make bench-peers``) a trial that kept each way's fastest
    round packed SmolLM2 on the Xeon, where packing slows one row (by the server's memory
    and speed: its log was gone). The whole model's weights, so that the trial reads
    memory as a decode step does rather than a cache. ``clock``: seconds, monotonic.

    >>> layer = torch.nn.Linear(16, 16)
    >>> packed = PackedLinear.from_linear(layer)
    >>> packed is None or packing_trial([(layer, packed)], repetitions=1).plain_seconds >= 0
    True
    """
    inputs = {}  # one input per width and dtype, shared by the layers that take it
    for plain, _ in pairs:
        key = (plain.in_features, plain.weight.dtype)
        if key not in inputs:
            inputs[key] = torch.randn(rows, plain.in_features,
                                      generator=torch.Generator().manual_seed(0)).to(key[1])
    calls = [(plain, packed, inputs[(plain.in_features, plain.weight.dtype)])
             for plain, packed in pairs]
    fastest = ([math.inf] * len(calls), [math.inf] * len(calls))

    def timed_round(way: int) -> None:
        best = fastest[way]
        for index, call in enumerate(calls):
            started = clock()
            call[way](call[2])
            best[index] = min(best[index], clock() - started)

    with torch.no_grad():
        for call in calls:  # one untimed pass each way
            call[0](call[2]), call[1](call[2])
        for _ in range(repetitions):
            for way in (0, 1):
                timed_round(way)
    return PackingTrial(sum(fastest[0]), sum(fastest[1]), rows)


def pack_linear_layers(model: torch.nn.Module, *, only_where_it_pays: bool = False,
                       trial_rows: int = 1, speedup_wanted: Optional[float] = None) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` (bfloat16 too, on a CPU that
    multiplies it natively) by its :class:`PackedLinear`, in place, and return how many
    were replaced. Each packed layer is checked against ``nn.Linear`` on a probe first; one
    that differs among the first :data:`TRIAL_BYTES` of weights leaves the model as it was,
    one further on stops the packing there (logged either way; the layers before it,
    which agreed, stay packed).

    ``only_where_it_pays``: first time ``trial_rows`` rows (one, unless a compiled
    program runs the one-row steps) through the first :data:`TRIAL_BYTES` of layers both
    ways (:func:`packing_trial`, while their packed copies exist anyway), and leave the
    model as it was where packing does not pay (:attr:`PackingTrial.pays`; logged either
    way). ``speedup_wanted``: where packing costs memory (copies beside plain weights a
    compiled program keeps reading), it pays only where the packed layers are this many
    times faster or more.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> pack_linear_layers(model) in (0, 2)
    True
    """
    replacements = packed_replacements(model, up_to_bytes=TRIAL_BYTES)
    if only_where_it_pays and replacements:
        trial = trial_of(replacements, rows=trial_rows)
        if not trial.pays:
            logger.info("linear layers left unpacked: oneDNN's packed layers are slower on "
                        "this CPU (%s; option.prepack_weights=true packs them anyway)", trial)
            return 0
        if speedup_wanted is not None and trial.speedup < speedup_wanted:
            logger.info("linear layers left unpacked: oneDNN's packed layers are %.2fx as "
                        "fast on this CPU, under the %.2fx their memory is packed for (%s; "
                        "option.prepack_weights=true packs them anyway)", trial.speedup,
                        speedup_wanted, trial)
            return 0
        logger.info("packing pays on this CPU (%s)", trial)
    return pack_from(model, replacements)


def packed_replacements(model: torch.nn.Module, *, up_to_bytes: Optional[int] = None) -> list:
    """``(parent, name, PackedLinear)`` for the layers of ``model`` that
    :func:`pack_linear_layers` would replace, in order, until their weights add up to
    ``up_to_bytes`` (all of them where ``None``), built but not put in place (the packed
    weights are copies: until they are, or are dropped, those weights are held twice); an
    empty list where nothing can be packed, or where a layer's packed output differs from
    its own on a probe (logged).

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    >>> [(name, type(layer).__name__) for _, name, layer in packed_replacements(model)] in (
    ...     [], [("0", "PackedLinear")])
    True
    """
    if packing_unavailable() is not None:
        return []
    replacements, held = [], 0
    for parent, name, child in plain_linear_layers(model):
        if up_to_bytes is not None and held >= up_to_bytes:
            break
        packed = _checked_twin(name, child)
        if packed is False:
            return []
        if packed is not None:
            replacements.append((parent, name, packed))
            held += child.weight.nbytes
    return replacements


def pack_from(model: torch.nn.Module, replacements) -> int:
    """Put ``replacements`` (from :func:`packed_replacements`) in place, then pack the
    layers still plain one at a time (:func:`install_replacements`: a large model's weights
    are never held twice, its plain weight goes as its packed copy arrives); how many
    layers were replaced, none where ``replacements`` is empty. A layer whose packed output
    differs from its own on a probe stops the packing there (logged); those before it stay
    packed."""
    if not replacements:
        return 0
    return install_replacements(model, replacements, then=lambda name, layer: _checked_twin(
        name, layer, stop="the layers from it on left unpacked"))


def _checked_twin(name: str, linear: torch.nn.Linear,
                  stop: str = "linear layers left unpacked"):
    """``linear``'s :class:`PackedLinear`; ``None`` where it cannot be packed; ``False``
    (logged, with ``stop``) where the packed layer differs from it on a probe."""
    packed = PackedLinear.from_linear(linear)
    if packed is not None and not agrees_on_probe(linear, packed, linear.in_features,
                                                  linear.weight.dtype):
        logger.warning("oneDNN's packed %s differs from nn.Linear on a probe: %s", name, stop)
        return False
    return packed


def trial_of(replacements, rows: int = 1) -> PackingTrial:
    """:func:`packing_trial` over ``replacements`` (from :func:`packed_replacements`, not
    yet in place) and the layers they would replace."""
    return packing_trial([(getattr(parent, name), packed) for parent, name, packed in replacements],
                         rows=rows)


def plain_linear_layers(model: torch.nn.Module):
    """``(parent, name, layer)`` for every plain ``nn.Linear`` in ``model`` (subclasses,
    quantized or LoRA layers, keep their own forward), listed before any is replaced."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if type(child) is torch.nn.Linear]


def install_replacements(model: torch.nn.Module, replacements, *,
                         then: Optional[Callable] = None) -> int:
    """Put each ``(parent, name, layer)`` of ``replacements`` (layers whose ``weight`` is
    derived from the ``nn.Linear`` they replace) in place; then, with ``then``, replace the
    layers still plain one at a time, each put in place before the next is made
    (``then(name, layer)`` gives its replacement, ``None`` to leave it, ``False`` to stop
    there): a list of them all made first would hold every original weight and its
    replacement at once. Returns how many layers were replaced.

    A replaced weight that another module still uses (a tied input embedding) is a copy
    and says so: ``weight.duplicates_a_weight`` is ``True``, and a count of the model's own
    weights skips it. The weights left as they were get memory of their own
    (:func:`own_the_other_weights`)."""
    kept = {id(p) for module in model.modules() if type(module) is not torch.nn.Linear
            for p in module.parameters(recurse=False)}

    def put(parent, name, layer) -> None:
        layer.weight.duplicates_a_weight = id(getattr(parent, name).weight) in kept
        setattr(parent, name, layer)

    for parent, name, layer in replacements:
        put(parent, name, layer)
    count = len(replacements)
    if then is not None:
        # (names, not the layers: a list of them would keep every plain weight to the end)
        for parent, name in [(parent, name) for parent, name, _ in plain_linear_layers(model)]:
            layer = then(name, getattr(parent, name))
            if layer is False:
                break
            if layer is not None:
                put(parent, name, layer)
                count += 1
    if count:
        own_the_other_weights(model)
    return count


def own_the_other_weights(model: torch.nn.Module) -> None:
    """Copy the parameters that were not packed or quantized here (embeddings, norms) into
    memory of their own.

    transformers maps a safetensors file into memory and its parameters are views of that
    one mapping, which stays as long as any of them lives. Packing read every weight
    through it, so the pages of the whole file stayed resident beside the packed copies
    (SmolLM2: 1.40 GB resident after packing instead of 1.00 GB) until the embedding, the
    last view, let go of the mapping. The same holds for the float32 originals of
    :class:`~djl_stream.generation.int8_linear.Int8Linear` and
    :class:`~djl_stream.generation.int8_weights.Int8WeightOnlyLinear` layers."""
    from djl_stream.generation.int8_linear import Int8Linear
    from djl_stream.generation.int8_weights import Int8WeightOnlyLinear

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (PackedLinear, Int8Linear, Int8WeightOnlyLinear)):
                continue
            for parameter in module.parameters(recurse=False):
                # a quantized weight (a tensor subclass) is left as its library made it
                if type(parameter) in _PLAIN_TENSORS and type(parameter.data) is torch.Tensor:
                    parameter.data = parameter.data.clone()
