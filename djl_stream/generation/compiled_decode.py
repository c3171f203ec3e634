"""The one-row decode step compiled ahead of time by AOTInductor and kept on disk
(``option.decode_step=compiled``, and on a CPU ``auto``, the default, for a model it runs).

:class:`OneRowGraph` is the decode step of a batch of one row
(:func:`~djl_stream.generation.llama_decode._decode_logits`) as a module over the model's
plain projection weights. :func:`compile_one_row` exports it (``torch.export``, with the
cache's column count and the attended span as dynamic sizes) and compiles it with
AOTInductor into a package, the whole step one C++ function. Each float32 product is
written as a reduction (:class:`OneRowProduct`), which Inductor compiles into a
vectorized loop reading the weight's rows in their plain layout as fast as the machine
streams memory: on a 2-core AMD EPYC (Zen 3) a one-row step of SmolLM2-135M takes 24 ms
against 47 ms with the products traced as matrix products (MKL's there) and 52-55 ms
eager (``python -m benchmarks.decode_step --compiled``, the same greedy tokens). On the
2-core Intel Xeon, where MKL's one-row products read at 25 GB/s, the program with matrix
products took 22.3 ms against 24.8 with reductions, so the load keeps ATen's products
where a trial finds them reading the weights no slower than a sum over them
(``OneRowGraph(model, matrix_products=True)``,
:mod:`~djl_stream.generation.one_row_products`). With ``option.quantize=w8a8`` the graph
holds its :class:`~djl_stream.generation.int8_linear.Int8Linear` layers: Inductor fuses
each row's rounding to int8 into the kernels around an integer product over the int8
weights, and a one-row step takes about 16 ms against about 34 ms for w8a8's eager step.
With ``option.quantize=int8`` (:mod:`~djl_stream.generation.int8_weights`) each product is
a reduction over the int8 weights, read as 32-bit words and taken apart by shifts
(:class:`~djl_stream.generation.int8_weights.Int8WeightProduct`), and a few-rows program
takes every batch of 2 to :data:`INT8_WEIGHTS_FEW_ROWS` rows.

``option.compiled_weights=shared`` adds a program for steps of :data:`BATCH_ROWS` rows
(:class:`BatchGraph`, :func:`compile_batch`), which reads the model's plain weights too: a
running batch of 7 to 16 rows (2 to 16 over ``w8a8``'s int8 layers:
:func:`~djl_stream.generation.llama_decode.first_rows_of`) is padded up to 16 and runs it
(padding rows leave their cache slots as they were), other sizes run the eager step. Its matrix products are the
eager step's; what it removes is everything between them. The rows are fixed: a program
for any row count (the row count a dynamic size) took 75 ms a step at 16 rows against
58 ms for this one and 66 ms eager (SmolLM2, 2-core Xeon).

A third program serves steps of 2 to :data:`FEW_ROWS` rows at their own row count
(:class:`FewRowsGraph`, :func:`compile_few_rows`; the rows a dynamic size), its products
reductions whose loop reads each row of the weight once for all the rows
(:class:`FewRowsProduct`): on the EPYC 31 ms a 2-row step, 43 a 4-row one and 65 a 6-row
one against 56, 64 and 75 for the eager step over packed layers; on the Xeon 31.7, 38.7
and 46.3 against 33.3, 54.5 and 56.4 for the eager step over MKL's products. Where the
layers are packed beside the plain weights (an AMD EPYC's case:
:func:`~djl_stream.generation.loading.prepare_for_decoding`) the 16-row program keeps a
copy of the weights of its own (``compile_batch(..., share_weights=False)``), which
Inductor's C++ GEMM template multiplies in its own blocked layout faster than oneDNN's
packed layers do: 61-72 ms a 16-row step against 89-105 eager.

The package is kept in a cache directory, keyed by everything its code depends on (the
weights' bytes, the model's geometry, this CPU, PyTorch's version, the step's source), so
only the first start on a machine pays the compile (about 90 s for SmolLM2); a restart
loads it in seconds. The cache is ``$TORCHINDUCTOR_CACHE_DIR/djl_stream_one_row`` (PyTorch's
own default, ``/tmp/torchinductor_$USER``, where the variable is unset): point it at a
volume that outlives the container to keep the package across container restarts.

``option.compiled_weights=shared`` (the default) compiles it without ``freezing`` instead
(``compile_one_row(model, share_weights=True)``): the weights stay the program's inputs in
their plain layout, and it is handed the model's own tensors, so it holds no copy; the cache entry is the program alone and
its key ignores the weights' bytes. With the products as reductions the two read the
weights alike: on the EPYC one stream through a server took 25 ms a token sharing them
and 26 with a copy (``python -m benchmarks.peers``, 2026-11-27).

What the cache holds per key (:class:`CacheEntry`) for a program with its own copy: the
package without weights, the constants the program reads (the weights and norms, loaded with ``mmap``: the
pages are the file's, shared by every worker on the machine) and the shapes of the
constants it does not read. AOTInductor keeps every weight of the exported module among
its constants (where a product packs a copy of its weight, as the C++ GEMM template of
a ``w8a8`` product may, the original is not read, and would double the file and the
memory); :func:`compile_one_row` finds out which are
read by running the program with each set to zeros, and those that are not read are
given to the loaded program as untouched anonymous memory (no physical pages). The
cache keeps the most recently used programs (:data:`KEPT_ENTRIES`,
:func:`evict_unused`).

Example::

    one_row = compile_one_row(model)   # before the model's own layers are packed
    if one_row is not None:
        logits = one_row.run(hidden, cos, sin, mask, keys, values, column, start)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import logging
import mmap
import os
import pickle
import platform
import shutil
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

import torch

from djl_stream.file_lock import exclusive_lock
from djl_stream.generation.aoti_call import released_gil_program
from djl_stream.generation.cpu_info import cpu_fields
from djl_stream.generation.int8_weights import (Int8WeightOnlyLinear, Int8WeightProduct,
                                                holds_int8_weights)
from djl_stream.generation import llama_decode

logger = logging.getLogger(__name__)

#: AOTInductor's settings for a program with weights of its own (see the module
#: docstring). The weights go beside the program rather than inside its shared library,
#: so that the cache can keep only those the program reads.
INDUCTOR_OPTIONS = {"freezing": True, "max_autotune": True,
                    "max_autotune_gemm_backends": "CPP,ATEN",
                    "aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": "pickle_weights"}
#: AOTInductor's settings for a program that reads the model's own weights: nothing is
#: frozen (the weights stay the program's inputs, in their plain layout, and its matrix
#: products are ATen's, as the eager step's), and the package holds none of them.
SHARED_WEIGHTS_OPTIONS = {"aot_inductor.package_constants_in_so": False,
                          "aot_inductor.package_constants_on_disk_format": "pickle_weights"}

#: The folder of a model directory that holds programs compiled for it (``djl-stream
#: compile MODEL_DIR``): looked in before the cache, and never written at load, so that a
#: container whose model directory is read-only (SageMaker's /opt/ml/model) starts
#: without compiling where the program there was compiled for its CPU and PyTorch.
SHIPPED_FOLDER = "compiled_decode"

#: How many programs a cache directory keeps, the most recently used (loaded or compiled)
#: ones: an entry with its own copy of the weights is hundreds of megabytes (519 MB for
#: SmolLM2 in float32), and every change of weights, PyTorch or CPU makes another; one that
#: shares the model's weights is a few (4 MB), and such a model has two (the one-row and
#: the 16-row program), so eight keep four models' programs. ``DJL_STREAM_COMPILED_CACHE_
#: ENTRIES`` sets another count (``0``: keep every one).
KEPT_ENTRIES = 8
KEPT_ENTRIES_VARIABLE = "DJL_STREAM_COMPILED_CACHE_ENTRIES"

#: The rows of the batch program that ``option.compiled_weights=shared`` adds
#: (:func:`compile_batch`): a batch of 7 rows (2 over ``w8a8``'s int8 layers) up to this many
#: (:func:`~djl_stream.generation.llama_decode.first_rows_of`) is padded up to it and runs
#: the program (fewer rows run the eager step: a program's step costs what its rows cost).
#: 16, the batch ``make bench-peers`` measures most.
BATCH_ROWS = 16

#: The most rows the few-rows program runs (:class:`FewRowsGraph`, :func:`compile_few_rows`):
#: it runs each step of 2 to this many rows at its own row count (a dynamic size). On the
#: 2-core AMD EPYC (Zen 3) of 2026-11-27 a step of SmolLM2 over buffers of 2,048 columns
#: (100 attended) took 30.5, 42.7 and 65.1 ms at 2, 4 and 6 rows against 56.2, 63.7 and
#: 75.2 for the eager step over packed layers (minimum of 3 rounds of 5 steps, the two in
#: turns, a ``/tmp`` script); a first version lost to it from 8 rows (102 against 91). On
#: the 2-core Intel Xeon of 2026-11-28 a program for up to 12 rows beat the 16-row program
#: at 7 rows (50.5 against 58.6 ms) and was level at 8 (56.6 against 59.1), and lost from 10
#: (69.0 against 60.1): 6 stays. There, with the layers plain, 2, 4 and 6 rows took 31.7,
#: 38.7 and 46.3 ms against 33.3, 54.5 and 56.4 for the eager step over MKL's products
#: (about 50 cached columns, medians of 3 rounds in turns), so the program serves them on
#: every CPU (:func:`~djl_stream.generation.loading.prepare_for_decoding`).
FEW_ROWS = 6
#: The most rows the few-rows program over ``option.quantize=int8``'s weight-only layers
#: runs: every batch the batch program would take, since their products cost less there
#: than the eager step's, which turns the whole int8 weight into floats at every call
#: (SmolLM2's 211 products at 16 rows on the EPYC: 102 ms in the program against 125).
INT8_WEIGHTS_FEW_ROWS = BATCH_ROWS

#: ``torch.export`` fixes a size of 0 or 1 seen in the example inputs, and a plain int
#: argument is not a dynamic size at all; the first column attended over (often 0) is
#: handed to the program as the length of an empty tensor this much longer.
_START_OFFSET = 2


# -- the module that is exported --------------------------------------------------------

class OneRowProduct(torch.nn.Module):
    """A float32 linear layer's product for one row written as a reduction (each output
    the sum of the row times a row of the weight), over the layer's own weight and bias
    (no copies), for :class:`OneRowGraph`.

    Why: traced as a matrix product, a one-row product runs ATen's (MKL's) or Inductor's
    C++ GEMM template, and on this project's 2-core AMD EPYC (Zen 3) MKL reads SmolLM2's
    538 MB of weights at 11-12 GB/s with one row, while Inductor compiles this reduction
    into one vectorized loop over the weight's rows, in their plain layout, that reads
    them as fast as the machine streams memory (27 GB/s; a plain sum over the same weights
    23-26). Measured in one process (a ``/tmp`` script, the 211 products of a SmolLM2 step
    in one compiled graph): 20.0 ms against 46.3 traced as ``linear``. Only for one row:
    with two or more the loop reads the weights once per row (4 rows: 76 ms), where the
    batch products are MKL's or oneDNN's.

    Example::

        >>> linear = torch.nn.Linear(4, 3)
        >>> x = torch.randn(1, 4)
        >>> torch.allclose(OneRowProduct(linear)(x), linear(x), atol=1e-6)
        True
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = (x.unsqueeze(-2) * self.weight).sum(-1)
        return products if self.bias is None else products + self.bias


class OneRowGraph(torch.nn.Module):
    """The decode step of one row as a module over ``model``'s own projection, norm and
    LM head weights (no copies), for :func:`torch.export.export`.

    ``start_marker`` is an empty tensor ``start + 2`` long (see ``_START_OFFSET``); the
    other inputs are those of :func:`~djl_stream.generation.llama_decode._decode_logits`
    for one row, the buffers one row deep.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
        >>> OneRowGraph.unsupported_reason(model) is None
        True
        >>> graph = OneRowGraph(model)
    """

    def __init__(self, model, matrix_products: bool = False):
        super().__init__()
        reason = self.unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        decoder = model.model
        #: whether its float32 products are ATen's matrix products rather than
        #: reductions (:mod:`~djl_stream.generation.one_row_products`)
        self.matrix_products = matrix_products
        product = _matrix_products_of if matrix_products else self._product
        self.geometry = llama_decode.Geometry.of(model.config)
        self.projections = torch.nn.ModuleList(
            torch.nn.ModuleDict({name: product(linear) for name, linear in
                                 llama_decode._projections_of(layer).items()})
            for layer in decoder.layers)
        self.norms = torch.nn.ParameterList(
            weight for layer in decoder.layers for weight in llama_decode._norms_of(layer))
        self.final_norm = decoder.norm.weight
        self.lm_head = product(model.lm_head)
        #: the rows of every step the program runs
        self.rows = 1

    @staticmethod
    def unsupported_reason(model) -> Optional[str]:
        """Why the graph cannot be built from ``model`` now, or ``None``: the model must be
        one :class:`~djl_stream.generation.llama_decode.LlamaDecodeStep` runs, with plain
        float32 linear layers (not yet packed), ``int8``'s
        :class:`~djl_stream.generation.int8_weights.Int8WeightOnlyLinear` layers or
        ``w8a8``'s :class:`~djl_stream.generation.int8_linear.Int8Linear` layers, whose
        integer products Inductor compiles too."""
        from djl_stream.generation.int8_linear import Int8Linear

        reason = llama_decode.unsupported_reason(model)
        if reason:
            return reason
        linears = [linear for layer in model.model.layers
                   for linear in llama_decode._projections_of(layer).values()]
        for linear in linears + [model.lm_head]:
            plain = type(linear) is torch.nn.Linear and linear.weight.dtype == torch.float32
            if not plain and type(linear) not in (Int8Linear, Int8WeightOnlyLinear):
                return (f"{type(linear).__name__} layers of {linear.weight.dtype}: the graph "
                        "is built from plain float32 weights, before packing, or from "
                        "option.quantize=int8's or w8a8's int8 layers")
        return None

    @staticmethod
    def _product(linear: torch.nn.Module) -> torch.nn.Module:
        """What multiplies by ``linear``'s weight in the graph: a float32 layer's one-row
        product as a reduction (:class:`OneRowProduct`), an int8 weight-only layer's
        :class:`~djl_stream.generation.int8_weights.Int8WeightProduct`; ``w8a8``'s int8
        layer as it is."""
        return _reduction_of(linear, OneRowProduct)

    def forward(self, hidden, cos, sin, mask, keys, values, column, start_marker):
        start = start_marker.shape[0] - _START_OFFSET
        return llama_decode._decode_logits(self.geometry, self._layers(), self.final_norm,
                                           self.lm_head, hidden, cos, sin, mask, keys, values,
                                           column, start)

    def _layers(self) -> List[dict]:
        # the norms read through the module in the traced call, so that export names them
        # by their place in it (a list made beforehand would make them anonymous constants,
        # which a program that reads the model's weights could not be given by name)
        return llama_decode._layer_dicts(
            [dict(layer) for layer in self.projections],
            [(self.norms[2 * i], self.norms[2 * i + 1]) for i in range(len(self.projections))])

    def example_inputs(self, columns: int = 5, start: int = 3, capacity: int = 16) -> tuple:
        """Inputs of a step for export, none of the dynamic sizes 0 or 1; random (seeded),
        so that every weight the program reads shows in its logits
        (:func:`_split_by_use`)."""
        g = self.geometry
        generator = torch.Generator().manual_seed(0)

        def random(*shape):
            return torch.randn(*shape, generator=generator)

        layers, rows = len(self.projections), self.rows
        angles = random(rows, 1, 1, g.head_dim)
        return (random(rows, self.final_norm.shape[0]), angles.cos(), angles.sin(),
                torch.zeros(rows, 1, 1, columns),
                [random(rows, g.kv_heads, capacity, g.head_dim) for _ in range(layers)],
                [random(rows, g.kv_heads, capacity, g.head_dim) for _ in range(layers)],
                torch.tensor([start + columns - 1]), torch.empty(start + _START_OFFSET))

    def dynamic_shapes(self) -> dict:
        """The sizes that change from step to step: the buffers' column capacity, the
        attended columns, the first of them."""
        dynamic = torch.export.Dim.DYNAMIC
        buffers = [{2: dynamic}] * len(self.projections)
        return {"hidden": None, "cos": None, "sin": None, "mask": {3: dynamic},
                "keys": buffers, "values": buffers, "column": None,
                "start_marker": {0: dynamic}}


class BatchGraph(OneRowGraph):
    """The decode step of a batch of ``rows`` rows (:func:`compile_batch`): the one-row
    graph's inputs ``rows`` deep, and ``real`` (``(rows, 1, 1, 1)`` booleans) marking the
    batch's own rows where it was padded up to ``rows``: a padding row writes back what
    its cache slot holds (a free slot, or one lent to a prompt being read, stays as it
    was), as in a CUDA graph's padded rows (:mod:`~djl_stream.generation.cuda_graphs`),
    but at its buffers' last column, so that its slot's pages are not made resident step
    after step.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
        >>> graph = BatchGraph(model, rows=4)
        >>> [tensor.shape[0] for tensor in graph.example_inputs()[:4]]
        [4, 4, 4, 4]
    """

    @staticmethod
    def _product(linear: torch.nn.Module) -> torch.nn.Module:
        # several rows: the layer's matrix product (a reduction would read the weight once
        # per row: OneRowProduct)
        return linear

    def __init__(self, model, rows: int):
        super().__init__(model)
        if rows < 2:
            raise ValueError("a batch program runs 2 rows or more (one row: OneRowGraph)")
        self.rows = rows

    def forward(self, hidden, cos, sin, mask, keys, values, column, start_marker, real):
        start = start_marker.shape[0] - _START_OFFSET
        return llama_decode._decode_logits(self.geometry, self._layers(), self.final_norm,
                                           self.lm_head, hidden, cos, sin, mask, keys, values,
                                           column, start, real=real,
                                           padding_to_last_column=True)

    def example_inputs(self, columns: int = 5, start: int = 3, capacity: int = 16) -> tuple:
        """The one-row graph's, ``rows`` deep, the last row padding."""
        real = torch.ones(self.rows, 1, 1, 1, dtype=torch.bool)
        real[-1] = False
        return (*super().example_inputs(columns, start, capacity), real)

    def dynamic_shapes(self) -> dict:
        return {**super().dynamic_shapes(), "real": None}


class FewRowsProduct(OneRowProduct):
    """A float32 linear layer's product for a few rows written as a reduction whose loop
    reads each row of the weight once for all the rows (the weight's rows outermost), for
    :class:`FewRowsGraph`; over the layer's own weight and bias, no copies.

    Why: on the AMD EPYC, MKL multiplies 2 to 6 rows by plain weights at 11 GB/s or less
    and oneDNN's packed layers do little better (SmolLM2's 211 products: 87 ms plain, 49
    packed at 4 rows), while this loop reads them at the memory's speed while the rows'
    arithmetic keeps up (the 211 products in one compiled graph: 21 ms at 2 rows, 40 at
    4, 51 at 8). Computed as ``(outputs, rows)``, the sums are handed on as a contiguous
    ``(rows, outputs)`` tensor whose layout ``as_strided`` pins: left to itself, Inductor
    gives the activations after it the transposed layout, and the next products then
    vectorize over the rows with a parallel region inside their loop over the outputs (a
    2-row step of a 2-layer model of SmolLM2's widths: 150-195 ms against 8-9).

    Example::

        >>> linear = torch.nn.Linear(4, 3)
        >>> x = torch.randn(2, 4)
        >>> torch.allclose(FewRowsProduct(linear)(x), linear(x), atol=1e-6)
        True
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = (self.weight.unsqueeze(1) * x.unsqueeze(0)).sum(-1)  # (outputs, rows)
        outputs, rows = sums.shape
        products = torch.as_strided(sums.t().contiguous(), (rows, outputs), (outputs, 1))
        return products if self.bias is None else products + self.bias


class FewRowsGraph(OneRowGraph):
    """The decode step of a batch of 2 to ``rows`` rows (by default :data:`FEW_ROWS`, or
    :data:`INT8_WEIGHTS_FEW_ROWS` over ``option.quantize=int8``'s layers) at
    its own row count, a dynamic size (:func:`compile_few_rows`): the one-row graph's
    inputs that many rows deep, its float32 products :class:`FewRowsProduct`'s, its int8
    weight-only ones :class:`~djl_stream.generation.int8_weights.Int8WeightProduct`'s.
    Not over ``w8a8``'s layers (their batch program runs from 2 rows).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
        >>> graph = FewRowsGraph(model)
        >>> graph.rows, graph.example_inputs()[0].shape[0]
        (6, 6)
    """

    @staticmethod
    def unsupported_reason(model) -> Optional[str]:
        reason = OneRowGraph.unsupported_reason(model)
        if reason is None and _holds_int8_layers(model):
            return "the few-rows program does not multiply w8a8's int8 layers"
        return reason

    @staticmethod
    def _product(linear: torch.nn.Module) -> torch.nn.Module:
        return _reduction_of(linear, FewRowsProduct)

    def __init__(self, model, rows: Optional[int] = None):
        super().__init__(model)
        if rows is None:  # (the program's products as its layers are)
            rows = INT8_WEIGHTS_FEW_ROWS if holds_int8_weights(model) else FEW_ROWS
        if rows < 3:  # (its row count a dynamic size from 2: a range, not one count)
            raise ValueError("a few-rows program runs 2 rows up to 3 or more; for 2 "
                             "rows alone, BatchGraph")
        self.rows = rows

    def forward(self, hidden, cos, sin, mask, keys, values, column, start_marker):
        start = start_marker.shape[0] - _START_OFFSET
        # Every row real, but written through the padded batch's way of indexing the
        # buffers themselves: a scatter into their first rows (a view, whose row count
        # the export does not see as the buffers' own) had the program copy each buffer
        # whole twice a layer, every step (a 4-row step over 2,048 columns: 90 ms
        # against 43)
        real = torch.ones(hidden.shape[0], 1, 1, 1, dtype=torch.bool, device=hidden.device)
        return llama_decode._decode_logits(self.geometry, self._layers(), self.final_norm,
                                           self.lm_head, hidden, cos, sin, mask, keys, values,
                                           column, start, real=real,
                                           padding_to_last_column=True)

    def dynamic_shapes(self) -> dict:
        rows = torch.export.Dim("rows", min=2, max=self.rows)
        dynamic = torch.export.Dim.DYNAMIC
        buffers = [{0: rows, 2: dynamic}] * len(self.projections)
        return {"hidden": {0: rows}, "cos": {0: rows}, "sin": {0: rows},
                "mask": {0: rows, 3: dynamic}, "keys": buffers, "values": buffers,
                "column": None, "start_marker": {0: dynamic}}


def _reduction_of(linear: torch.nn.Module, float_product: type) -> torch.nn.Module:
    """``linear``'s product in a graph whose products are reductions: ``float_product``'s
    for a float32 layer, :class:`~djl_stream.generation.int8_weights.Int8WeightProduct`
    for an int8 weight-only one, any other layer (``w8a8``'s) as it is."""
    if type(linear) is torch.nn.Linear:
        return float_product(linear)
    if type(linear) is Int8WeightOnlyLinear:
        return Int8WeightProduct(linear)
    return linear


def _matrix_products_of(linear: torch.nn.Module) -> torch.nn.Module:
    """``linear``'s product in a one-row graph with ATen's matrix products: a float32
    layer as it is (its own product), the others as :func:`_reduction_of` has them (ATen
    has no product over int8 weight-only bytes)."""
    return _reduction_of(linear, lambda plain: plain)


def _described_graph(graph: OneRowGraph) -> str:
    """How the log names ``graph``'s program."""
    if isinstance(graph, FewRowsGraph):
        return f"2- to {graph.rows}-row"
    return "one-row" if graph.rows == 1 else f"{graph.rows}-row"


# -- the loaded program ----------------------------------------------------------------

class CompiledOneRow:
    """A loaded one-row program and the constants it was given (they must outlive it:
    the program holds their addresses, not references).

    ``run`` takes :func:`~djl_stream.generation.llama_decode._decode_logits`'s inputs for
    one row (``start`` a plain int) and returns its logits, writing the new column into
    the buffers as the eager step does."""

    def __init__(self, program, constants: Dict[str, torch.Tensor], path: Path,
                 from_cache: bool, shares_weights: bool = False):
        self._program = program
        self._constants = constants
        #: the cache entry the program was loaded from
        self.path = path
        #: whether it was found there (``False``: compiled by this process)
        self.from_cache = from_cache
        #: whether it reads the model's own weights (else copies of its own, in the
        #: layout its kernels read)
        self.shares_weights = shares_weights
        #: the rows of every step it runs (a batch program's: :func:`compile_batch`)
        self.rows = 1

    def run(self, hidden, cos, sin, mask, keys, values, column, start: int, real=None):
        """The logits of a step (``real``: a batch program's, see :class:`BatchGraph`)."""
        inputs = (hidden, cos, sin, mask, keys, values, column,
                  torch.empty(start + _START_OFFSET))
        return self._program(*inputs) if real is None else self._program(*inputs, real)


# -- the cache -------------------------------------------------------------------------

def cache_root() -> Path:
    """Where packages are kept: ``djl_stream_one_row`` in Inductor's cache directory
    (``$TORCHINDUCTOR_CACHE_DIR``, else PyTorch's default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "djl_stream_one_row"


def _cpu_identity() -> str:
    """This CPU's model and instruction-set flags: the package's C++ is built with
    ``-march=native``, and would not run (or not as tuned) on another CPU."""
    seen = cpu_fields(("model name", "flags", "Features", "CPU part"))
    if seen is None:
        return f"{platform.machine()} {platform.processor()}"
    return json.dumps(seen, sort_keys=True)


def inductor_options(share_weights: bool) -> dict:
    """AOTInductor's settings for a program that reads the model's weights
    (``share_weights``) or copies of its own."""
    return dict(SHARED_WEIGHTS_OPTIONS if share_weights else INDUCTOR_OPTIONS)


def cache_key(graph: OneRowGraph, share_weights: bool = False) -> str:
    """A digest of everything the compiled program depends on: the weights' names, shapes
    and dtypes (their bytes too where the program keeps its own copies: a program that
    reads the model's weights serves any weights of that shape, a fine-tune say), the
    geometry, this CPU, PyTorch's version, Inductor's settings and the source of the step
    (:func:`_step_sources`)."""
    digest = hashlib.blake2b(digest_size=20)
    # ("products=matrix" only where it holds: the keys of programs with reductions, and
    # the programs model directories ship with them, stay what they were)
    products = ["products=matrix"] if graph.matrix_products else []
    for text in (torch.__version__, repr(graph.geometry), f"rows={graph.rows}", _cpu_identity(),
                 json.dumps(inductor_options(share_weights), sort_keys=True),
                 str(_START_OFFSET), *products,
                 *_step_sources(_holds_int8_layers(graph), type(graph),
                                holds_int8_weights(graph))):
        digest.update(text.encode())
    for name, tensor in graph.state_dict(keep_vars=True).items():
        tensor = tensor.detach().contiguous()
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        if not share_weights:
            digest.update(tensor.view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _step_sources(int8_layers: bool, graph_type: type = OneRowGraph,
                  int8_weights: bool = False) -> tuple:
    """The source of the code a program of ``graph_type`` is traced from, ``w8a8``'s int8
    layers' too where the graph holds them (``int8_layers``), ``int8``'s weight-only
    products' where it holds those (``int8_weights``): an edit to it means another program (edits elsewhere, in the
    cache's own code or in the int8 layers for a float32 program, say, do not). Read once,
    under a lock: ``inspect.getsource`` parses the module, and CPython 3.11's parser fails
    now and then when two threads parse at once ("AST constructor recursion depth
    mismatch")."""
    import inspect

    from djl_stream.generation import int8_linear

    traced = (OneRowGraph, OneRowProduct, _reduction_of, llama_decode.Geometry,
              llama_decode._decode_logits, llama_decode._norm, llama_decode._rotate, llama_decode._mlp,
              llama_decode._qkv, llama_decode._layer_dicts)
    if int8_layers:
        traced += (int8_linear.Int8Linear, int8_linear.quantize_rows)
    if int8_weights:
        traced += (Int8WeightProduct,)
    if graph_type is BatchGraph:
        traced += (BatchGraph,)
    elif graph_type is FewRowsGraph:
        traced += (FewRowsGraph, FewRowsProduct)
    with _SOURCES_LOCK:
        return tuple(inspect.getsource(code) for code in traced)


_SOURCES_LOCK = threading.Lock()


def _holds_int8_layers(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a graph, or a model) holds ``w8a8``'s int8 layers."""
    from djl_stream.generation.int8_linear import Int8Linear

    return any(isinstance(inner, Int8Linear) for inner in module.modules())


def model_weights(graph: OneRowGraph) -> Dict[str, torch.Tensor]:
    """The model's own tensors that a program sharing its weights is given, by the names
    the program loads them by (``graph``'s state: no copies)."""
    return {name: tensor.detach() for name, tensor in graph.state_dict(keep_vars=True).items()}


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """A cache entry's files: ``program.pt2`` (the AOTInductor package, no weights) and,
    for a program with weights of its own, ``constants.pt`` (the constants it reads) and
    ``unread.json`` (name, shape and dtype of those it does not); for one that reads the
    model's weights, ``shared.json`` (their names, shapes and dtypes) instead."""

    directory: Path

    @property
    def program(self) -> Path:
        return self.directory / "program.pt2"

    @property
    def constants(self) -> Path:
        return self.directory / "constants.pt"

    @property
    def unread(self) -> Path:
        return self.directory / "unread.json"

    @property
    def shared(self) -> Path:
        return self.directory / "shared.json"

    def complete(self) -> bool:
        return self.program.is_file() and (
            self.shared.is_file() or (self.constants.is_file() and self.unread.is_file()))

    def megabytes(self) -> float:
        """The size of the entry's files."""
        return sum(path.stat().st_size for path in self.directory.iterdir()) / 1e6

    def load(self, from_cache: bool,
             weights: Optional[Dict[str, torch.Tensor]] = None) -> CompiledOneRow:
        """The program with its constants: for a program that reads the model's weights,
        ``weights`` (:func:`model_weights`, which must match ``shared.json``); else those
        it reads mapped from ``constants.pt``, the others untouched anonymous memory."""
        if self.shared.is_file():
            _check_weights(weights, json.loads(self.shared.read_text()))
            constants = dict(weights)
        else:
            constants = torch.load(self.constants, mmap=True, weights_only=True)
            for name, (shape, dtype) in json.loads(self.unread.read_text()).items():
                constants[name] = _untouched(shape, getattr(torch, dtype))
        # called with the GIL released where this PyTorch allows it (see aoti_call)
        program = released_gil_program(self.program, constants)
        if program is None:
            program = torch._inductor.aoti_load_package(str(self.program))
            program.load_constants(constants, check_full_update=True, user_managed=True)
        return CompiledOneRow(program, constants, self.directory, from_cache,
                              shares_weights=self.shared.is_file())


def _described(tensors: Dict[str, torch.Tensor]) -> Dict[str, list]:
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch.")]
            for name, t in tensors.items()}


def _check_weights(weights: Optional[Dict[str, torch.Tensor]], expected: Dict[str, list]):
    """Refuse weights other than those the program was compiled for (the program reads
    them by address: another shape would be read out of bounds), or not contiguous."""
    if weights is None or _described(weights) != expected:
        raise ValueError("the program reads weights of other names, shapes or dtypes")
    if not all(t.is_contiguous() for t in weights.values()):
        raise ValueError("the program reads contiguous weights")


def _untouched(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` over anonymous memory that is never written: it takes no
    physical memory, and reads as zeros."""
    count = 1
    for size in shape:
        count *= size
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


# -- compiling -------------------------------------------------------------------------

def compile_one_row(model, *, share_weights: bool = False, cache: Optional[Path] = None,
                    shipped: Optional[Path] = None,
                    matrix_products: bool = False) -> Optional[CompiledOneRow]:
    """``model``'s one-row program from the cache, or compiled into it; ``None`` (logged)
    where the model is not one it runs or compiling fails (no C++ compiler, say). Call it
    before the model's layers are packed: it reads their plain weights.

    ``share_weights``: the program reads the model's own weight tensors (the program
    holds them: they must not change shape or place) rather than copies of its own: no
    memory of its own, a cached program that serves any weights of the same shapes, and
    a step as fast (its reductions read plain weights either way: 25 against 26 ms a
    token through a server on the AMD EPYC of 2026-11-27).

    ``cache``: the cache directory, :func:`cache_root` by default; where it cannot be
    written, the package is compiled into a temporary directory, removed once loaded.
    ``shipped``: a model directory's :data:`SHIPPED_FOLDER`, read (without a lock, never
    written) before the cache; its program is taken where its key is this one's.
    ``matrix_products``: its float32 products ATen's matrix products rather than
    reductions (where this CPU's one-row products read the weights as fast:
    :mod:`~djl_stream.generation.one_row_products`).
    """
    reason = OneRowGraph.unsupported_reason(model)
    if reason:
        logger.warning("no compiled one-row decode step: %s", reason)
        return None
    return _program_of(OneRowGraph(model, matrix_products), share_weights, cache, shipped)


def compile_batch(model_or_graph, rows: int = BATCH_ROWS, *, share_weights: bool = True,
                  cache: Optional[Path] = None,
                  shipped: Optional[Path] = None) -> Optional[CompiledOneRow]:
    """The program for decode steps of ``rows`` rows (:class:`BatchGraph`, given, or
    built from a model), from the cache or compiled into it, as :func:`compile_one_row`'s;
    ``None`` (logged) where the model is not one it runs or compiling fails.

    By default it reads the model's own plain weights (``share_weights``): no copy, and
    matrix products through ATen as the eager step's, whose cost the program does not
    change; what it saves is the rest of the step (norms, rotary embedding, residuals and
    activations fused into a few C++ loops, the residual additions into the products, no
    Python between operators). SmolLM2 on the 2-core Xeon, 16 rows over 150 cached
    columns: 58 ms against 66 for the eager step, 57.5 ms for 9 rows padded to 16 against
    62.5 (a ``/tmp`` script timing the program and ``_decode_logits`` in turn).

    With ``share_weights=False`` it keeps a copy of its own, frozen into the program, and
    Inductor's autotuning may multiply it with its C++ GEMM template over the copy in the
    template's own blocked layout: on the 2-core AMD EPYC, whose MKL multiplies plain
    weights at 5-7 GB/s with 4 to 16 rows, a 16-row step of SmolLM2 took 61-72 ms against
    89-105 for the eager step over oneDNN's packed layers (see
    :func:`~djl_stream.generation.loading.prepare_for_decoding`). A graph built before the
    model's layers are packed keeps their plain weights to copy."""
    if isinstance(model_or_graph, BatchGraph):
        graph = model_or_graph
    else:
        reason = OneRowGraph.unsupported_reason(model_or_graph)
        if reason:
            logger.warning("no compiled %d-row decode step: %s", rows, reason)
            return None
        graph = BatchGraph(model_or_graph, rows)
    return _program_of(graph, share_weights, cache, shipped)


def compile_few_rows(model_or_graph, *, cache: Optional[Path] = None,
                     shipped: Optional[Path] = None) -> Optional[CompiledOneRow]:
    """The program for decode steps of 2 to :data:`FEW_ROWS` rows (:class:`FewRowsGraph`,
    given, or built from a model) over the model's own plain float32 weights, from the
    cache or compiled into it, as :func:`compile_one_row`'s; ``None`` (logged) where the
    model is not one it runs or compiling fails. Its ``rows`` is the most rows it runs;
    a step runs it at its own row count (no padding).

    A graph built before the model's layers are packed keeps reading their plain
    weights afterwards (:func:`~djl_stream.generation.loading.prepare_for_decoding`
    builds it before the packing trial, and compiles it only where the layers were
    packed)."""
    if isinstance(model_or_graph, FewRowsGraph):
        graph = model_or_graph
    else:
        reason = FewRowsGraph.unsupported_reason(model_or_graph)
        if reason:
            logger.warning("no compiled few-rows decode step: %s", reason)
            return None
        graph = FewRowsGraph(model_or_graph)
    return _program_of(graph, True, cache, shipped)


def _program_of(graph: OneRowGraph, share_weights: bool, cache: Optional[Path],
                shipped: Optional[Path]) -> Optional[CompiledOneRow]:
    """``graph``'s program from ``shipped``, else the cache, else compiled; ``None``
    where compiling fails (logged)."""
    started = time.perf_counter()
    what = _described_graph(graph)
    weights = model_weights(graph) if share_weights else None
    try:
        key = cache_key(graph, share_weights)
        program = None
        if shipped is not None:  # before the cache, which it then leaves untouched
            entry = CacheEntry(Path(shipped) / key)
            program = _loaded(entry, started, weights, where="the model directory",
                              otherwise="using the cache", what=what)
            if program is None and not entry.complete():
                _log_other_keys(Path(shipped), key)
        if program is None:
            program = _cached_or_compiled(graph, key, weights, cache, started)
        if program is not None:
            program.rows = graph.rows
        return program
    except Exception as error:  # noqa: BLE001 - the eager step serves those steps then
        logger.warning("compiling the %s decode step failed (%s: %s); %s steps run the eager "
                       "step", what, type(error).__name__,
                       str(error).splitlines()[0] if str(error) else "", what)
        return None


def _cached_or_compiled(graph: OneRowGraph, key: str,
                        weights: Optional[Dict[str, torch.Tensor]], cache: Optional[Path],
                        started: float) -> CompiledOneRow:
    """The program of ``key`` from the cache ``cache`` (:func:`cache_root` by default), or
    compiled into it (into a temporary directory where it cannot be written); then the
    least recently used entries beyond :func:`kept_entries` are evicted.

    A cache whose key lock cannot be created (a directory mounted read-only, or baked into
    an image and owned by another user) is read without the lock: nobody can be writing it
    then. Its program is taken where it holds one; else the program is compiled into a
    temporary directory, as for a cache that cannot be created."""
    temporary = one_row = None
    writable = False
    what = _described_graph(graph)
    try:
        try:
            root = Path(cache) if cache is not None else cache_root()
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            root = temporary = _temporary_cache(f"the {what} program's cache cannot be "
                                                f"written ({error})")
        entry = CacheEntry(root / key)
        with contextlib.ExitStack() as held:
            try:
                # workers starting together compile once: the others wait, then load it
                held.enter_context(exclusive_lock(root / f"{key}.lock"))
                writable = temporary is None
            except OSError as error:
                logger.info("the %s program's cache %s is read-only (%s): read without "
                            "its lock", what, root, error)
            one_row = _loaded(entry, started, weights, where="the cache",
                              otherwise="compiling it again", what=what)
            if one_row is not None:
                if writable:
                    _mark_used(entry)
                return one_row
            if not writable and temporary is None:
                root = temporary = _temporary_cache(f"the read-only cache {root} holds no "
                                                    "program for this model")
                entry = CacheEntry(root / key)
            if entry.directory.exists():  # incomplete, or does not load (logged)
                shutil.rmtree(entry.directory, ignore_errors=True)
            logger.info("compiling the %s decode program (once per machine and model "
                        "shapes: 1.5 to 4 minutes for SmolLM2 on a 2-core CPU; "
                        "option.decode_step=eager goes without it)", what)
            _compile_apart(graph, entry, share_weights=weights is not None)
        one_row = entry.load(from_cache=False, weights=weights)
        kept = entry.megabytes()
    finally:
        if temporary is not None:  # what the loaded program maps stays until it is unmapped
            shutil.rmtree(temporary, ignore_errors=True)
        elif one_row is not None and writable:
            evict_unused(root, kept_entries())
    logger.info("the %s decode program was compiled in %.0f s%s (%.0f MB)", what,
                time.perf_counter() - started,
                "" if temporary else f" and kept in {entry.directory}", kept)
    return one_row


def _temporary_cache(why: str) -> Path:
    """A temporary directory to compile into (removed once the program is loaded), and
    ``why`` logged."""
    logger.warning("%s; compiling into a temporary directory, removed once it is loaded", why)
    return Path(tempfile.mkdtemp(prefix="djl_stream_one_row-"))


def _loaded(entry: CacheEntry, started: float, weights: Optional[Dict[str, torch.Tensor]],
            *, where: str, otherwise: str, what: str = "one-row") -> Optional[CompiledOneRow]:
    """The program ``entry`` holds, or ``None`` where it holds none or one that does not
    load (a file cut short by a full disk, say: logged, saying what happens ``otherwise``).
    ``where``: the entry's place, for the log."""
    if not entry.complete():
        return None
    try:
        one_row = entry.load(from_cache=True, weights=weights)
    except Exception as error:  # noqa: BLE001 - the caller goes on without it
        logger.warning("the %s decode program in %s (%s) does not load (%s: %s); %s",
                       what, where, entry.directory, type(error).__name__,
                       str(error).splitlines()[0] if str(error) else "", otherwise)
        return None
    logger.info("the %s decode program was loaded from %s (%s) in %.1f s", what, where,
                entry.directory, time.perf_counter() - started)
    return one_row


def _log_other_keys(folder: Path, key: str) -> None:
    """Say so where a model directory ships programs, but none for ``key``."""
    if folder.is_dir() and any(path.is_dir() for path in folder.iterdir()):
        logger.info("the model directory's compiled programs (%s) were compiled for another "
                    "CPU, PyTorch, weights or djl-stream (none has key %s); using the cache",
                    folder, key)


def ship(one_row: CompiledOneRow, model_dir: Path) -> Path:
    """Copy ``one_row``'s cache entry into ``model_dir``'s :data:`SHIPPED_FOLDER`, where
    :func:`compile_one_row` finds it on a machine with this CPU and PyTorch, and return the
    copy's path (an older copy of the same key is replaced)."""
    if not CacheEntry(one_row.path).complete():
        raise ValueError(f"the program's files are no longer in {one_row.path} (compiled "
                         "into a temporary directory where the cache could not be written?)")
    folder = Path(model_dir) / SHIPPED_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / one_row.path.name
    work = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=folder))
    try:
        shutil.copytree(one_row.path, work, dirs_exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _mark_used(entry: CacheEntry) -> None:
    """Record that ``entry`` was used now (its directory's modification time), for
    :func:`evict_unused`."""
    try:
        os.utime(entry.directory)
    except OSError as error:  # a read-only cache: nothing is evicted from it either
        logger.debug("could not mark %s as used: %s", entry.directory, error)


def kept_entries() -> int:
    """How many programs a cache keeps: ``$DJL_STREAM_COMPILED_CACHE_ENTRIES``, else
    :data:`KEPT_ENTRIES` (also where the variable is not a count, logged)."""
    value = os.environ.get(KEPT_ENTRIES_VARIABLE, "").strip()
    if not value:
        return KEPT_ENTRIES
    try:
        count = int(value)
        if count < 0:
            raise ValueError(value)
    except ValueError:
        logger.warning("%s=%r is not a count of entries (0 keeps every one); keeping %d",
                       KEPT_ENTRIES_VARIABLE, value, KEPT_ENTRIES)
        return KEPT_ENTRIES
    return count


def evict_unused(root: Path, keep: int) -> List[Path]:
    """Remove the entries of the cache ``root`` beyond the ``keep`` most recently used
    (``keep=0``: none), and return them. An entry that another process is compiling or
    loading right now (its key's lock is held) is left alone; one that a running
    process loaded earlier is safe to remove (its program and constants stay mapped).

    >>> import tempfile
    >>> evict_unused(Path(tempfile.mkdtemp()), keep=1)
    []
    """
    if keep <= 0:
        return []
    try:
        entries = [path for path in root.iterdir()
                   if path.is_dir() and "." not in path.name]  # not a compile's work dir
        entries.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    except OSError as error:
        logger.warning("could not list the one-row programs' cache %s: %s", root, error)
        return []
    removed = []
    for path in entries[keep:]:
        with exclusive_lock(root / f"{path.name}.lock", wait=False) as held:
            if not held:
                continue
            shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    if removed:
        logger.info("removed %d least recently used one-row program(s) from %s (it keeps "
                    "%d; %s sets another count)", len(removed), root, keep,
                    KEPT_ENTRIES_VARIABLE)
    return removed


def _find_compiler() -> None:
    """Raise where Inductor finds no C++ compiler (its own search, ``cpp.cxx`` included)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    get_cpp_compiler()


def _compile_apart(graph: OneRowGraph, entry: CacheEntry, share_weights: bool) -> None:
    """:func:`_compile_into`, in a child process (forked) where the system forks (Linux);
    in this one otherwise. What the compile raised in the child is raised here.

    Why: a compile leaves this process holding what it made (exported graphs, Inductor's
    frozen and packed constants, autotuning's inputs), which no collection gives back. With
    ``freezing`` (a program with its own copy) it is gigabytes: on the 2-core AMD EPYC a
    process that compiled SmolLM2's 16-row program with its copy held 3,666 MB (3,621 after
    dropping the program, the model and the graph, ``gc.collect()`` and ``malloc_trim``),
    one that loaded it from the cache 883 MB; compiled in a child, the parent held 898 MB
    once it had loaded the program (``/tmp`` scripts, 2026-11-27). Programs that share the
    model's weights left less, but still hundreds of megabytes, until the server's
    restart: on the 2-core Intel Xeon a float32 server that compiled its three programs
    held 1,383 MB after a benchmark's load against 1,103 for one that loaded them from
    the cache, an ``option.quantize=int8`` one 1,456 against 752 (2026-11-28)."""
    if not sys.platform.startswith("linux"):
        _compile_into(graph, entry, share_weights)
        return
    _find_compiler()  # (here, as in-process: before anything is forked)
    _run_in_a_child(lambda: _compile_into(graph, entry, share_weights))


def _run_in_a_child(work) -> None:
    """Run ``work()`` in a forked child process and wait for it to end; where it raised,
    raise its exception here (pickled through a pipe; one that does not pickle, or
    unpickle, as a :class:`RuntimeError` that names it).

    The fork is made from a thread started for it, in a copy of the caller's context
    (Inductor's settings patched by the caller are context variables): a child has only
    the thread that forked, and a thread that has run PyTorch's OpenMP loops leaves the
    child its OpenMP team, whose workers were not copied; the child's next parallel loop
    then waits for them for ever (seen: a test's compile hung in
    ``gomp_team_barrier_wait_end``). A new thread has no team, and OpenMP starts one for
    the child."""
    reading, writing = os.pipe()
    forked = {}

    def fork():
        try:
            forked["pid"] = os.fork()
        except OSError as error:
            forked["error"] = error
            return
        if forked["pid"] == 0:  # the child: work, then leave without Python's exit handlers
            code = 1
            try:
                os.close(reading)
                work()
                code = 0
            except BaseException as error:  # noqa: BLE001 - handed to the parent
                logger.debug("in the child process", exc_info=True)
                os.write(writing, _pickled(error))
            finally:
                os._exit(code)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(fork,),
                              name="djl-stream-fork")
    thread.start()
    thread.join()
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        if "error" in forked:
            raise forked["error"]
        told = pipe.read()  # (before waiting: a child blocks on a full pipe)
    _, status = os.waitpid(forked["pid"], 0)
    if told:
        try:
            error = pickle.loads(told)
        except Exception as unpickling:  # noqa: BLE001 - said instead
            error = RuntimeError(f"the child process failed; its exception did not unpickle "
                                 f"({unpickling})")
        raise error
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"the child process exited with {code}")


def _pickled(error: BaseException) -> bytes:
    """``error`` pickled, or a :class:`RuntimeError` naming it where it does not pickle."""
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception of the child's that pickle refuses
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))


def _compile_into(graph: OneRowGraph, entry: CacheEntry, share_weights: bool = False) -> None:
    """Export and compile ``graph``, keep what the program reads (nothing where it reads
    the model's weights: their description), and move the files into ``entry`` at once (a
    crash leaves no half-written entry behind)."""
    _find_compiler()  # Inductor would fail only after the export
    work = Path(tempfile.mkdtemp(prefix=f"{entry.directory.name}.", dir=entry.directory.parent))
    try:
        example = graph.example_inputs()
        with torch.no_grad():
            exported = torch.export.export(graph, example, dynamic_shapes=graph.dynamic_shapes())
        package = work / "full.pt2"
        torch._inductor.aoti_compile_and_package(  # (it adds to the options it is given)
            exported, package_path=str(package),
            inductor_configs=inductor_options(share_weights))
        _strip_weights(package, work / "program.pt2")
        if share_weights:
            (work / "shared.json").write_text(json.dumps(_described(model_weights(graph))))
        else:
            constants = _packaged_constants(package)
            originals = set(exported.state_dict) | set(exported.constants)
            read, unread = _split_by_use(package, constants, originals, example)
            torch.save(read, work / "constants.pt")
            (work / "unread.json").write_text(json.dumps(_described(unread)))
        package.unlink()
        if entry.directory.exists():  # an incomplete entry from an older failure
            shutil.rmtree(entry.directory)
        os.replace(work, entry.directory)
        _mark_used(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _packaged_constants(package: Path) -> Dict[str, torch.Tensor]:
    """Every constant of an AOTInductor package written with ``pickle_weights``, by the
    name the program loads it by."""
    import io

    with zipfile.ZipFile(package) as archive:
        names = archive.namelist()
        (config_name,) = [n for n in names if n.endswith("/weights_config.json")]
        prefix = config_name.split("/data/")[0] + "/data/weights/"
        constants = {}
        for name, (file, shape, stride, offset) in json.loads(archive.read(config_name)).items():
            stored = torch.load(io.BytesIO(archive.read(prefix + file)), weights_only=True)
            constants[name] = stored.as_strided(shape, stride, offset).clone()
    return constants


def _split_by_use(package: Path, constants: Dict[str, torch.Tensor], originals: set,
                  example: tuple):
    """``constants`` split into those the program reads and those it does not: each of
    the exported module's own weights (``originals``) is set to zeros in turn (all at
    once first: usually none is read), and one whose zeros change the logits is read."""
    program = torch._inductor.aoti_load_package(str(package))
    program.load_constants(constants, check_full_update=True, user_managed=True)

    def logits():
        buffers = [[b.clone() for b in group] for group in example[4:6]]
        return program(*example[:4], *buffers, *example[6:])

    expected = logits()
    candidates = [name for name in constants if name in originals]
    zeros = {name: torch.zeros_like(constants[name]) for name in candidates}

    def unchanged_without(names: List[str]) -> bool:
        program.load_constants({n: zeros[n] for n in names}, check_full_update=False,
                               user_managed=True)
        same = torch.equal(logits(), expected)
        program.load_constants({n: constants[n] for n in names}, check_full_update=False,
                               user_managed=True)
        return same

    if unchanged_without(candidates):
        unread_names = set(candidates)
    else:
        unread_names = {name for name in candidates if unchanged_without([name])}
    read = {n: t for n, t in constants.items() if n not in unread_names}
    unread = {n: t for n, t in constants.items() if n in unread_names}
    return read, unread


def _strip_weights(package: Path, stripped: Path) -> None:
    """A copy of ``package`` without its pickled weights (the cache keeps the constants
    the program reads in a file of its own)."""
    with zipfile.ZipFile(package) as source, \
            zipfile.ZipFile(stripped, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            if "/data/weights/" not in info.filename:
                target.writestr(info, source.read(info.filename))
