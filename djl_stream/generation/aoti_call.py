"""An AOTInductor package's program, called with Python's GIL released.

PyTorch's loader (``torch._inductor.aoti_load_package``) runs a program through a pybind11
call that keeps the GIL for the whole run. For the compiled one-row decode step
(:mod:`~djl_stream.generation.compiled_decode`) that is a whole decode step, 22 ms of
SmolLM2 on this project's 2-core CPU, during which no other Python thread runs: a thread
ticking every 0.5 ms beside compiled steps saw gaps of 21.6 ms (p90), against 0.6 ms beside
eager steps, whose operators release the GIL. A server's HTTP thread could then write a
token's line only between two steps, and a compiled server's first tokens came 20-50 ms
later than the default server's.

:class:`ReleasedGilProgram` opens the package's shared library itself and calls the C entry
points every AOTInductor library exports (declared in PyTorch's
``torch/csrc/inductor/aoti_runtime/interface.h``: ``AOTInductorModelContainerCreateWithDevice``,
``...UpdateUserManagedConstantBufferPairs``, ``...Run``) through :mod:`ctypes`, which
releases the GIL around every foreign call. Tensors cross as ``AtenTensorHandle`` pointers
made and taken back by ``torch._C._aoti``'s helpers, as PyTorch's own C++-wrapper code does.
Called so, the ticker's gaps were 0.6 ms (p90), a step took as long (21.4-21.8 ms against
21.3-21.6, the same tokens), and the compiled servers' first tokens came in 92-93 ms against
the default's 87 (``python -m benchmarks.compiled_weights``). Where
any of it is missing (an older PyTorch without the ``...Pairs`` entry point, a package for
a GPU), :func:`released_gil_program` returns ``None`` and the caller keeps PyTorch's loader.

Example::

    program = released_gil_program(Path("entry/program.pt2"), constants)
    logits = program(hidden, cos, sin, mask, keys, values, column, offset)
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import tempfile
import weakref
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.utils import _pytree as pytree

logger = logging.getLogger(__name__)


class _ConstantEntry(ctypes.Structure):
    """``AOTInductorConstantMapEntry``: a constant's name and its ``AtenTensorHandle``."""

    _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]


def _declare(library: ctypes.CDLL) -> None:
    """The argument types of the entry points used (all return an ``int32`` status)."""
    handle, size, pointer = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
    signatures = {
        "AOTInductorModelContainerCreateWithDevice":
            [ctypes.POINTER(handle), size, ctypes.c_char_p, ctypes.c_char_p],
        "AOTInductorModelContainerDelete": [handle],
        "AOTInductorModelContainerGetNumOutputs": [handle, ctypes.POINTER(size)],
        "AOTInductorModelContainerGetNumConstants": [handle, ctypes.POINTER(size)],
        "AOTInductorModelContainerGetConstantName":
            [handle, size, ctypes.POINTER(ctypes.c_char_p)],
        "AOTInductorModelContainerGetConstantOriginalFQN":
            [handle, size, ctypes.POINTER(ctypes.c_char_p)],
        "AOTInductorModelContainerGetCallSpec":
            [handle, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)],
        "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs":
            [handle, ctypes.POINTER(_ConstantEntry), size, ctypes.c_bool, ctypes.c_bool],
        "AOTInductorModelContainerRun":
            [handle, ctypes.POINTER(pointer), size, ctypes.POINTER(pointer), size, pointer,
             pointer],
    }
    for name, arguments in signatures.items():
        function = getattr(library, name)  # AttributeError where the library lacks it
        function.argtypes = arguments
        function.restype = ctypes.c_int32


# torch._C._aoti's helpers pass AtenTensorHandles as unnamed PyCapsules
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_pointer.restype = ctypes.c_void_p
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_new_capsule.restype = ctypes.py_object


def _handles(tensors: List[torch.Tensor]) -> List[int]:
    """A new ``AtenTensorHandle`` (an owning ``at::Tensor*``) for each of ``tensors``."""
    return [_capsule_pointer(capsule, None)
            for capsule in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)]


def _tensors(handles) -> List[torch.Tensor]:
    """The tensors of ``handles``, which are taken over (freed with the tensors)."""
    return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
        [_new_capsule(handle, None, None) for handle in handles])


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"AOTInductor's {what} failed (status {status})")


class ReleasedGilProgram:
    """A package's program run through its C entry points, the GIL released while it runs
    (see the module docstring). Called like PyTorch's loaded program; ``constants`` (by
    name, user-managed: the program keeps their addresses) must outlive it."""

    def __init__(self, package: Path, constants: Dict[str, torch.Tensor]):
        # extracted for the loading only: once loaded, the library stays mapped
        folder = Path(tempfile.mkdtemp(prefix="djl_stream_aoti-"))
        try:
            library_path = _extract_library(package, folder)
            library = ctypes.CDLL(str(library_path))  # CDLL, not PyDLL: calls release the GIL
            _declare(library)
            container = ctypes.c_void_p()
            _check(library.AOTInductorModelContainerCreateWithDevice(
                ctypes.byref(container), 1, b"cpu", str(folder).encode()),
                "container creation")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._library, self._container = library, container
        # handles the container holds (user-managed constants): freed after it
        self._constant_handles: List[int] = []
        weakref.finalize(self, _release, library, container, self._constant_handles)
        outputs = ctypes.c_size_t()
        _check(library.AOTInductorModelContainerGetNumOutputs(container, ctypes.byref(outputs)),
               "output count")
        self._outputs = outputs.value
        in_spec, out_spec = ctypes.c_char_p(), ctypes.c_char_p()
        _check(library.AOTInductorModelContainerGetCallSpec(
            container, ctypes.byref(in_spec), ctypes.byref(out_spec)), "call spec")
        self._out_spec = pytree.treespec_loads(out_spec.value.decode())
        # the constants are given by their original names (the exported module's), the
        # container knows them by its own, as PyTorch's loader maps them
        own_names = _constant_names(library, container)
        unknown = set(constants) - set(own_names)
        if unknown:
            raise ValueError(f"the program has no constant {sorted(unknown)[0]!r}")
        fqns = list(constants)
        names = [own_names[fqn] for fqn in fqns]
        handles = _handles([constants[fqn] for fqn in fqns])
        self._constant_handles.extend(handles)
        entries = (_ConstantEntry * len(names))(
            *[_ConstantEntry(name.encode(), handle) for name, handle in zip(names, handles)])
        _check(library.AOTInductorModelContainerUpdateUserManagedConstantBufferPairs(
            container, entries, len(names), False, True), "constants update")

    def __call__(self, *args):
        inputs = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        # the handles are the container's to free once it has run
        handles = _handles(inputs)
        input_array = (ctypes.c_void_p * len(handles))(*handles)
        output_array = (ctypes.c_void_p * self._outputs)()
        _check(self._library.AOTInductorModelContainerRun(
            self._container, input_array, len(handles), output_array, self._outputs,
            None, None), "run")
        outputs = _tensors(list(output_array))
        return pytree.tree_unflatten(outputs, self._out_spec)


def _constant_names(library, container) -> Dict[str, str]:
    """The container's name of each constant, by its original (module) name."""
    count = ctypes.c_size_t()
    _check(library.AOTInductorModelContainerGetNumConstants(container, ctypes.byref(count)),
           "constant count")
    names = {}
    for index in range(count.value):
        name, fqn = ctypes.c_char_p(), ctypes.c_char_p()
        _check(library.AOTInductorModelContainerGetConstantName(container, index,
                                                                ctypes.byref(name)), "name")
        _check(library.AOTInductorModelContainerGetConstantOriginalFQN(container, index,
                                                                       ctypes.byref(fqn)), "FQN")
        names[fqn.value.decode()] = name.value.decode()
    return names


def _extract_library(package: Path, folder: Path) -> Path:
    """The package's shared library (``data/aotinductor/model/*.so``: a CPU program needs
    nothing else, its constants are given), extracted into ``folder``."""
    with zipfile.ZipFile(package) as archive:
        libraries = [name for name in archive.namelist()
                     if "/data/aotinductor/model/" in name and name.endswith(".so")]
        if len(libraries) != 1:
            raise ValueError(f"{package} holds {len(libraries)} shared libraries, not one")
        target = folder / Path(libraries[0]).name
        target.write_bytes(archive.read(libraries[0]))
    return target


def _release(library, container, constant_handles: List[int]) -> None:
    library.AOTInductorModelContainerDelete(container)
    _tensors(constant_handles)  # taken back, and freed with them


def released_gil_program(package: Path, constants: Dict[str, torch.Tensor]
                         ) -> Optional[ReleasedGilProgram]:
    """``package``'s program called with the GIL released, or ``None`` (logged) where this
    PyTorch or this package does not allow it: the caller then loads it with PyTorch's
    loader."""
    try:
        return ReleasedGilProgram(Path(package), constants)
    except Exception as error:  # noqa: BLE001 - PyTorch's loader serves instead
        logger.info("the compiled program runs through PyTorch's loader, which holds the GIL "
                    "while it runs (%s: %s)", type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "")
        return None
