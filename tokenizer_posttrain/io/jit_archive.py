"""The weights of a TorchScript archive (``.jit``), read without running anything in it.

``torch.jit.load`` executes the archive: its classes' ``__setstate__`` and any TorchScript the file holds run at
load, so a crafted file can write files, or loop forever, before a single weight is looked at. The official Cosmos
weights ship as ``.jit`` and users download fine-tuned ones from strangers, so the archive is read here as data:

- the archive is a zip; ``data.pkl`` is the module tree, pickled. It is unpickled by :class:`_ArchiveUnpickler`,
  whose ``find_class`` hands out inert stand-ins for the archive's own ``__torch__.*`` classes, a tensor rebuilder
  and the storage type markers, and refuses every other global (``os.system``, ``builtins.eval``, ...): nothing a
  file names is imported or called;
- tensors are rebuilt from the ``data/<key>`` records, with sizes, strides and offsets checked against the record;
- which attributes of a class are parameters and buffers is declared in its ``code/`` file as
  ``__parameters__ = [...]`` and ``__buffers__ = [...]``: that file is parsed as text (``ast``), never run.

The result is the ``state_dict`` of the module ``torch.jit.load`` would build, key for key and value for value
(``tests/io/test_jit_archive.py`` compares them), and anything else in the archive is refused in one line.
"""

from __future__ import annotations

import ast
import io
import os
import pickle  # restricted to _ArchiveUnpickler.find_class below: only our own stand-ins are ever built
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.errors import CheckpointError

MAX_PICKLE_BYTES = 256 << 20
"""The largest ``data.pkl`` read: a real tokenizer's is well under 1 MiB (the tensors are separate records)."""
MAX_CODE_BYTES = 16 << 20
"""The largest ``code/`` file parsed for a class's declarations (a real one is a few KiB)."""
MAX_MODULE_DEPTH = 200
"""Deepest module nesting followed (the Cosmos tokenizers nest under 12 levels)."""

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
"""The storage type markers ``torch.jit.save`` writes for dense tensors, and their dtypes."""


class _Refused(Exception):
    """Something in the archive that is not weights and plain data; the message says what."""


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def __setstate__(self, state: Any) -> None:
        raise _Refused("a tensor with extra state")


@dataclass(eq=False)
class _ScriptObject:
    """An inert stand-in for an instance of one of the archive's ``__torch__`` classes: its attributes, nothing
    else (no method of the class exists here)."""

    qualified_name: str
    attributes: dict[str, Any] = field(default_factory=dict)
    built: bool = False

    def __setstate__(self, state: Any) -> None:
        if self.built or not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise _Refused(f"an object of class {self.qualified_name} with a state that is not a dict of attributes")
        self.attributes, self.built = state, True


def _rebuild_tensor(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False, hooks: Any = None, *extra: Any
) -> _TensorRef:
    # The signature of torch._utils._rebuild_tensor_v2, which is what the archive names; the values are checked
    # here and the tensor is only made once every record is known (_Archive.tensor).
    def ints(value: Any) -> bool:
        return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)

    if not isinstance(storage, _StorageRef) or type(offset) is not int or offset < 0:
        raise _Refused("a tensor that does not point into a storage record")
    if not ints(size) or not ints(stride) or len(size) != len(stride) or len(size) > 16:
        raise _Refused(f"a tensor with sizes {size!r} and strides {stride!r}")
    if extra or not isinstance(requires_grad, bool) or (hooks is not None and hooks != {}):
        raise _Refused("a tensor with hooks or metadata")
    if 0 not in size and offset + sum((n - 1) * s for n, s in zip(size, stride, strict=False)) >= storage.numel:
        raise _Refused(f"a tensor of size {list(size)} that reaches past its storage record {storage.key}")
    return _TensorRef(storage, offset, size, stride)


def _empty_dict() -> dict[str, Any]:
    # collections.OrderedDict in the archive: the (empty) backward hooks of each tensor.
    return {}


def _typed_list(data: Any) -> list[Any]:
    # torch.jit._pickle.build_intlist and its siblings: a scripted module's typed list attributes, as plain lists.
    if not isinstance(data, list):
        raise _Refused(f"a typed list built from a {type(data).__name__}")
    return data


def _type_tag(value: Any, type_str: Any) -> Any:
    # torch.jit._pickle.restore_type_tag: the TorchScript type of a container, which plain data does not need.
    if not isinstance(type_str, str):
        raise _Refused("a type tag that is not a string")
    return value


_JIT_PICKLE_HELPERS: dict[str, Any] = {
    "build_intlist": _typed_list,
    "build_doublelist": _typed_list,
    "build_boollist": _typed_list,
    "build_tensorlist": _typed_list,
    "restore_type_tag": _type_tag,
}
"""The functions of ``torch.jit._pickle`` that scripted modules' archives name, as inert equivalents."""


class _ArchiveUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` into stand-ins, tensor references and plain containers; every other global is
    refused, so no function or class the file names is ever imported or called."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if module == "__torch__" or module.startswith("__torch__."):
            return self.classes.setdefault(qualified, _stand_in(qualified))
        if qualified == "torch._utils._rebuild_tensor_v2":
            return _rebuild_tensor
        if qualified == "collections.OrderedDict":
            return _empty_dict
        if module == "torch.jit._pickle" and name in _JIT_PICKLE_HELPERS:
            return _JIT_PICKLE_HELPERS[name]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _Refused(f"a reference to {qualified}, which is not a tensor or a TorchScript class")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], torch.dtype)
            and isinstance(pid[2], str)
            and pid[2].isdigit()
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            return _StorageRef(pid[1], pid[2], pid[4])
        raise _Refused(f"a reference {pid!r:.80} that is not a tensor storage")


def _stand_in(qualified: str) -> type:
    # NEWOBJ calls cls.__new__(cls): each __torch__ class becomes a subclass whose instances know their name.
    def new(cls: type, *args: Any) -> _ScriptObject:
        if args:
            raise _Refused(f"an object of class {qualified} built with arguments")
        return _ScriptObject(qualified)

    return type("_StandIn", (), {"__new__": new})


@dataclass(frozen=True)
class _ClassDecl:
    module: bool
    parameters: tuple[str, ...]
    buffers: tuple[str, ...]


class _Archive:
    """The records of one archive, opened once."""

    def __init__(self, archive: zipfile.ZipFile, size: int) -> None:
        self.zip, self.size = archive, size
        pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise _Refused("no data.pkl (it is not a TorchScript archive)")
        self.prefix = pickles[0][: -len("data.pkl")]
        self.names = set(archive.namelist())
        self.declarations: dict[str, _ClassDecl] = {}
        self.storages: dict[str, Tensor] = {}

    def read(self, name: str, limit: int | None = None) -> bytes:
        if self.prefix + name not in self.names:
            raise _Refused(f"no record {name}")
        info = self.zip.getinfo(self.prefix + name)
        if limit is not None and info.file_size > limit:
            raise _Refused(f"a record {name} of {info.file_size} bytes")
        return self.zip.read(info)

    def storage(self, ref: _StorageRef) -> Tensor:
        found = self.storages.get(ref.key)
        if found is None:
            name = f"{self.prefix}data/{ref.key}"
            if name not in self.names:
                raise _Refused(f"no record data/{ref.key} for a tensor")
            info = self.zip.getinfo(name)
            nbytes = ref.numel * torch.empty((), dtype=ref.dtype).element_size()
            if info.file_size != nbytes:
                raise _Refused(f"a record data/{ref.key} of {info.file_size} bytes for {nbytes} bytes of tensor")
            if info.compress_type != zipfile.ZIP_STORED or nbytes > self.size:
                # torch.jit.save stores tensors uncompressed; a compressed one could inflate far beyond the file.
                raise _Refused(f"a compressed or oversized tensor record data/{ref.key}")
            buffer = bytearray(nbytes)
            with self.zip.open(info) as record:
                if record.readinto(buffer) != nbytes:
                    raise _Refused(f"a record data/{ref.key} shorter than its header says")
            found = torch.frombuffer(buffer, dtype=ref.dtype) if nbytes else torch.empty(0, dtype=ref.dtype)
            self.storages[ref.key] = found
        elif found.dtype != ref.dtype:
            raise _Refused(f"storage record data/{ref.key} used as {found.dtype} and {ref.dtype}")
        return found

    def tensor(self, ref: _TensorRef) -> Tensor:
        return self.storage(ref.storage).as_strided(ref.size, ref.stride, ref.offset)

    def declaration(self, qualified: str) -> _ClassDecl:
        """Whether ``qualified`` is a module, and the parameters and buffers its ``code/`` file declares."""
        found = self.declarations.get(qualified)
        if found is not None:
            return found
        module, _, name = qualified.rpartition(".")
        text = self.read("code/" + module.replace(".", "/") + ".py", MAX_CODE_BYTES).decode("utf-8", "replace")
        try:
            tree = ast.parse(text)  # parsed to read two lists of names; never compiled or run
        except (SyntaxError, ValueError):
            raise _Refused(f"a code file for {qualified} that is not TorchScript") from None
        decl = None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                lists = {}
                for item in node.body:
                    if isinstance(item, ast.Assign) and len(item.targets) == 1:
                        target = item.targets[0]
                        if isinstance(target, ast.Name) and target.id in ("__parameters__", "__buffers__"):
                            lists[target.id] = _names(item.value, qualified)
                is_module = any(isinstance(b, ast.Name) and b.id == "Module" for b in node.bases)
                decl = _ClassDecl(is_module, lists.get("__parameters__", ()), lists.get("__buffers__", ()))
        if decl is None:
            raise _Refused(f"no declaration of class {qualified} in its code file")
        self.declarations[qualified] = decl
        return decl


def _names(node: ast.expr, qualified: str) -> tuple[str, ...]:
    if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return tuple(e.value for e in node.elts)  # type: ignore[attr-defined]
    raise _Refused(f"a class {qualified} whose parameters or buffers are not a list of names")


def _state_dict(archive: _Archive, root: Any) -> dict[str, Tensor]:
    """The module tree's parameters and buffers in ``nn.Module.state_dict`` order: a module's own parameters,
    then its buffers, each in attribute order, then each submodule's."""
    state: dict[str, Tensor] = {}
    seen: set[int] = set()

    def walk(obj: _ScriptObject, prefix: str, depth: int) -> None:
        if depth > MAX_MODULE_DEPTH:
            raise _Refused(f"modules nested more than {MAX_MODULE_DEPTH} deep")
        if id(obj) in seen:
            raise _Refused(f"a module ({prefix or 'the root'}) that appears twice in the tree")
        seen.add(id(obj))
        decl = archive.declaration(obj.qualified_name)
        if not decl.module:
            raise _Refused(f"{prefix or 'the root'}: an object of class {obj.qualified_name}, not a module")
        for kind in (decl.parameters, decl.buffers):
            for name, value in obj.attributes.items():
                if name not in kind or value is None:
                    continue
                if not isinstance(value, _TensorRef):
                    raise _Refused(f"{prefix}{name}: a {type(value).__name__} declared as a tensor")
                state[prefix + name] = archive.tensor(value)
        for name, value in obj.attributes.items():
            if isinstance(value, _ScriptObject) and archive.declaration(value.qualified_name).module:
                walk(value, f"{prefix}{name}.", depth + 1)

    if not isinstance(root, _ScriptObject):
        raise _Refused(f"a {type(root).__name__} at the top, not a module")
    walk(root, "", 0)
    return state


def _open_regular(path: Path) -> io.BufferedReader:
    # O_NONBLOCK: a FIFO planted at the path would block a plain open until someone writes to it.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as err:
        raise CheckpointError(f"cannot open {path}: {err.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file (a folder, FIFO or device): pass the weights file itself")
    return os.fdopen(fd, "rb")


def read_jit_state(path: str | Path) -> dict[str, Tensor]:
    """The parameters and buffers of the TorchScript module in ``path``, as the ``state_dict`` of the module
    ``torch.jit.load`` would build, read without running anything the archive holds. An archive that holds
    anything but modules, tensors and plain data, or that is damaged, raises a one-line :class:`CheckpointError`
    naming the file."""
    path = Path(path)
    with _open_regular(path) as handle:
        try:
            with zipfile.ZipFile(handle) as archive:
                reader = _Archive(archive, os.fstat(handle.fileno()).st_size)
                has_order = reader.prefix + "byteorder" in reader.names
                byteorder = reader.read("byteorder", 16).decode() if has_order else ""
                if byteorder not in ("", "little"):
                    raise _Refused(f"tensors stored {byteorder}-endian")
                root = _ArchiveUnpickler(reader.read("data.pkl", MAX_PICKLE_BYTES)).load()
                return _state_dict(reader, root)
        except _Refused as err:
            raise CheckpointError(
                f"refusing to load {path}: it holds {err}. A TorchScript tokenizer file holds only modules and "
                "their tensors, and nothing else in it is ever run; use the official files or one you trust"
            ) from None
        except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError, UnicodeDecodeError, OSError) as err:
            raise CheckpointError(
                f"cannot read {path}: {str(err).strip() or type(err).__name__}. The file looks truncated or is not a "
                "TorchScript archive; download it again (compare its size with the published one)."
            ) from None
        except (RecursionError, MemoryError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
            # The C unpickler's own complaints about a malformed stream (a BUILD on a list, a REDUCE of a non-
            # callable, an exhausted stack): the file is damaged or crafted either way.
            raise CheckpointError(
                f"cannot read {path}: its data.pkl is malformed ({type(err).__name__}: {str(err)[:120]}). The file "
                "is damaged or not a TorchScript archive written by torch.jit.save."
            ) from None
