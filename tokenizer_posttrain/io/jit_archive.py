"""The weights of a TorchScript archive (``.jit``), read without running anything in it.

``torch.jit.load`` executes the archive: its classes' ``__setstate__`` and any TorchScript the file holds run at
load, so a crafted file can write files, or loop forever, before a single weight is looked at. The official Cosmos
weights ship as ``.jit`` and users download fine-tuned ones from strangers, so the archive is read here as data:

- the archive is a zip; ``data.pkl`` is the module tree, pickled. No unpickler reads it: :class:`_PickleMachine`
  walks its opcodes (``pickletools.genops`` only parses them) and knows the few that ``torch.jit.save`` writes.
  A class the stream names becomes an inert stand-in (:class:`_ScriptObject`) for the archive's own
  ``__torch__.*`` classes, tensors become references checked against their ``data/<key>`` records, and any other
  global (``os.system``, ``builtins.eval``, ...) or opcode is refused: nothing a file names is imported or called,
  and no container of the file's is hashed, compared or printed (a crafted one can make that take forever);
- which attributes of a class are parameters and buffers is declared in its ``code/`` file as
  ``__parameters__ = [...]``, ``__buffers__ = [...]`` and ``name : Type`` lines: they are read as text, line by
  line, never run or even parsed as a program.

The result is the ``state_dict`` of the module ``torch.jit.load`` would build, key for key and value for value
(``tests/io/test_jit_archive.py`` compares them), and anything else in the archive is refused in one line.
"""

from __future__ import annotations

import ast
import math
import os
import pickletools
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.errors import CheckpointError
from ..core.untrusted import one_line, open_regular, why_unreadable

MAX_PICKLE_BYTES = 8 << 20
"""The largest ``data.pkl`` read: the real CV8x8x8's is 62 KB (the tensors are separate records)."""
MAX_CODE_BYTES = 1 << 20
"""The largest ``code/`` file read for a class's declarations (the real CV8x8x8's largest is 3 KiB)."""
MAX_CODE_TOTAL = 8 << 20
"""The most ``code/`` text read from one archive (the real CV8x8x8's 443 files hold 258 KiB): each file is small,
but a crafted archive can name thousands, each inflating from a few bytes."""
MAX_MODULE_DEPTH = 200
"""Deepest module nesting followed (the Cosmos tokenizers nest under 12 levels)."""
MAX_ELEMENTS = 1 << 48
"""Most elements of one tensor (a real one has under 2**30)."""

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
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexHalfStorage": torch.complex32,
    "Float8_e4m3fnStorage": torch.float8_e4m3fn,
    "Float8_e5m2Storage": torch.float8_e5m2,
    "UInt16Storage": torch.uint16,
    "UInt32Storage": torch.uint32,
    "UInt64Storage": torch.uint64,
}
"""The storage type markers ``torch.jit.save`` writes for dense tensors, and their dtypes."""


class _Refused(Exception):
    """Something in the archive that is not weights and plain data; the message says what."""


def _shown(name: str) -> str:
    """A name read from the file, fit for a one-line message."""
    return one_line(name, 80)


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


@dataclass(frozen=True)
class _ClassRef:
    """A ``__torch__.*`` class the stream names: only ever instantiated as a :class:`_ScriptObject`."""

    qualified_name: str


@dataclass(eq=False)
class _ScriptObject:
    """An inert stand-in for an instance of one of the archive's ``__torch__`` classes: its attributes, nothing
    else (no method of the class exists here)."""

    qualified_name: str
    attributes: dict[str, Any] = field(default_factory=dict)
    built: bool = False

    def build(self, state: Any) -> None:
        if self.built or type(state) is not dict or not all(type(k) is str for k in state):
            raise _Refused(f"an object of class {_shown(self.qualified_name)} whose state is not a dict of attributes")
        self.attributes, self.built = state, True


def _rebuild_tensor(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False, hooks: Any = None, *extra: Any
) -> _TensorRef:
    # The arguments of torch._utils._rebuild_tensor_v2, which is what the archive names; the values are checked
    # here and the tensor is only made once every record is known (_Archive.tensor).
    def ints(value: Any) -> bool:
        return type(value) is tuple and len(value) <= 16 and all(type(v) is int and v >= 0 for v in value)

    if type(storage) is not _StorageRef or type(offset) is not int or offset < 0:
        raise _Refused("a tensor that does not point into a storage record")
    if not ints(size) or not ints(stride) or len(size) != len(stride):
        raise _Refused("a tensor whose sizes and strides are not lists of counts")
    if extra or type(requires_grad) is not bool or not (hooks is None or (type(hooks) is dict and not hooks)):
        raise _Refused("a tensor with hooks or metadata")
    if math.prod(size) > MAX_ELEMENTS:
        raise _Refused(f"a tensor of {math.prod(size)} elements")
    if 0 not in size and offset + sum((n - 1) * s for n, s in zip(size, stride, strict=False)) >= storage.numel:
        raise _Refused(f"a tensor of size {list(size)} that reaches past its storage record {storage.key}")
    return _TensorRef(storage, offset, size, stride)


def _empty_dict() -> dict[str, Any]:
    # collections.OrderedDict in the archive: the (empty) backward hooks of each tensor.
    return {}


def _typed_list(data: Any) -> list[Any]:
    # torch.jit._pickle.build_intlist and its siblings: a scripted module's typed list attributes, as plain lists.
    if type(data) is not list:
        raise _Refused("a typed list that is not a list")
    return data


def _type_tag(value: Any, type_str: Any) -> Any:
    # torch.jit._pickle.restore_type_tag: the TorchScript type of a container, which plain data does not need.
    if type(type_str) is not str:
        raise _Refused("a type tag that is not a string")
    return value


_FUNCTIONS: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "collections.OrderedDict": _empty_dict,
    "torch.jit._pickle.build_intlist": _typed_list,
    "torch.jit._pickle.build_doublelist": _typed_list,
    "torch.jit._pickle.build_boollist": _typed_list,
    "torch.jit._pickle.build_tensorlist": _typed_list,
    "torch.jit._pickle.restore_type_tag": _type_tag,
}
"""The functions an archive may name, as inert equivalents of torch's (the only things REDUCE may call)."""
_CALLABLE = frozenset(map(id, _FUNCTIONS.values()))

_PLAIN_KEYS = (str, int, float, bool, type(None))
"""Types a dict key may have: hashing anything else (a tuple nested a million deep, or built from shared parts)
can take forever or crash the interpreter."""


class _PickleMachine:
    """Runs the opcodes of a ``data.pkl`` that build data: containers, numbers, strings, stand-ins and tensor
    references. Every other opcode, every global outside :data:`_FUNCTIONS`, the storage markers and ``__torch__``
    classes, and every call outside :data:`_FUNCTIONS` is refused."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}  # a dict, not a list: a crafted index costs one entry, not gigabytes

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if (module == "__torch__" or module.startswith("__torch__.")) and name.isidentifier():
            return _ClassRef(qualified)
        if qualified in _FUNCTIONS:
            return _FUNCTIONS[qualified]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module == "torch" and name.endswith("Storage")) or qualified.startswith("torch._utils._rebuild_"):
            # Quantized and sparse tensors: no tokenizer holds them, and their rebuilders take more than data.
            raise _Refused(f"quantized or sparse tensors ({_shown(qualified)}), which no tokenizer holds")
        raise _Refused(f"a reference to {_shown(qualified)}, which is not a tensor or a TorchScript class")

    @staticmethod
    def persistent_load(pid: Any) -> _StorageRef:
        if (
            type(pid) is tuple
            and len(pid) == 5
            and pid[0] == "storage"
            and type(pid[1]) is torch.dtype
            and type(pid[2]) is str
            and pid[2].isdigit()
            and type(pid[4]) is int
            and 0 <= pid[4] <= MAX_ELEMENTS
        ):
            return _StorageRef(pid[1], pid[2], pid[4])
        raise _Refused("a persistent reference that is not a tensor storage")

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise _Refused("a malformed pickle stream (no mark)")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def pop(self) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise _Refused("a malformed pickle stream (stack underflow)")
        return self.stack.pop()

    def peek(self) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise _Refused("a malformed pickle stream (nothing to remember)")
        return self.stack[-1]

    def top(self, kind: type) -> Any:
        if not self.stack or type(self.stack[-1]) is not kind:
            raise _Refused(f"a malformed pickle stream (no {kind.__name__} to add to)")
        return self.stack[-1]

    @staticmethod
    def key(value: Any) -> Any:
        if type(value) not in _PLAIN_KEYS:
            raise _Refused(f"a dict key of type {type(value).__name__}")
        return value

    def run(self) -> Any:
        push = self.stack.append
        for opcode, arg, _ in pickletools.genops(self.data):
            op = opcode.name
            if op in ("PROTO", "FRAME"):
                continue
            if op == "STOP":
                if len(self.stack) != 1 or self.marks:
                    raise _Refused("a malformed pickle stream (items left at its end)")
                return self.stack[0]
            if op == "MARK":
                self.marks.append(len(self.stack))
            elif op == "NONE":
                push(None)
            elif op in ("NEWTRUE", "NEWFALSE"):
                push(op == "NEWTRUE")
            elif op in ("BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT"):
                push(arg)
            elif op in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"):
                push(arg)
            elif op == "EMPTY_DICT":
                push({})
            elif op == "EMPTY_LIST":
                push([])
            elif op == "EMPTY_TUPLE":
                push(())
            elif op == "TUPLE":
                push(tuple(self.pop_mark()))
            elif op in ("TUPLE1", "TUPLE2", "TUPLE3"):
                count = int(op[-1])
                items = [self.pop() for _ in range(count)][::-1]
                push(tuple(items))
            elif op == "LIST":
                push(self.pop_mark())
            elif op == "APPEND":
                value = self.pop()
                self.top(list).append(value)
            elif op == "APPENDS":
                items = self.pop_mark()
                self.top(list).extend(items)
            elif op == "SETITEM":
                value, key = self.pop(), self.pop()
                self.top(dict)[self.key(key)] = value
            elif op == "SETITEMS":
                items = self.pop_mark()
                if len(items) % 2:
                    raise _Refused("a malformed pickle stream (a key without a value)")
                target = self.top(dict)
                for key, value in zip(items[::2], items[1::2], strict=False):
                    target[self.key(key)] = value
            elif op in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
                self.memo[len(self.memo) if op == "MEMOIZE" else arg] = self.peek()
            elif op in ("BINGET", "LONG_BINGET"):
                if arg not in self.memo:
                    raise _Refused("a malformed pickle stream (a reference to nothing)")
                push(self.memo[arg])
            elif op == "GLOBAL":
                module, _, name = arg.partition(" ")
                push(self.find_class(module, name))
            elif op == "STACK_GLOBAL":
                name, module = self.pop(), self.pop()
                if type(module) is not str or type(name) is not str:
                    raise _Refused("a malformed pickle stream (a global that is not named)")
                push(self.find_class(module, name))
            elif op == "BINPERSID":
                push(self.persistent_load(self.pop()))
            elif op == "REDUCE":
                args, function = self.pop(), self.pop()
                if id(function) not in _CALLABLE or type(args) is not tuple:
                    raise _Refused(f"a call of a {type(function).__name__}, which only runs code")
                try:
                    push(function(*args))
                except TypeError:  # the wrong number of arguments
                    raise _Refused(f"a call of {function.__name__} with {len(args)} arguments") from None
            elif op == "NEWOBJ":
                args, cls = self.pop(), self.pop()
                if type(cls) is not _ClassRef or args != ():
                    raise _Refused("an object built with arguments, or of a class that is not the archive's")
                push(_ScriptObject(cls.qualified_name))
            elif op == "BUILD":
                state = self.pop()
                target = self.top(_ScriptObject)
                target.build(state)
            else:
                raise _Refused(f"the pickle opcode {op}, which torch.jit.save never writes")
        raise _Refused("a malformed pickle stream (no end)")


@dataclass(frozen=True)
class _ClassDecl:
    module: bool
    parameters: frozenset[str]
    buffers: frozenset[str]
    """Declared buffers whose annotation is ``Tensor`` (an ``Optional[Tensor]`` one is not in the state dict)."""


_CLASS_LINE = re.compile(r"class (\w+)(?:\((.*)\))?:\s*")
_MEMBER_LINE = re.compile(r"  (\w+) : (.+?)\s*")
_LIST_LINE = re.compile(r"  (__parameters__|__buffers__) = (.*)")


def _declarations(text: str, where: str) -> dict[str, _ClassDecl]:
    """Each class of a ``code/`` file: whether it is a module, its parameters and its buffers, read from the
    lines ``torch.jit.save`` writes at the top of each class body (two spaces in)."""
    found: dict[str, _ClassDecl] = {}
    name: str | None = None
    lists: dict[str, frozenset[str]] = {}
    annotations: dict[str, str] = {}
    bases = ""

    def close() -> None:
        if name is not None:
            buffers = frozenset(b for b in lists.get("__buffers__", ()) if annotations.get(b) == "Tensor")
            found[name] = _ClassDecl(bases == "Module", lists.get("__parameters__", frozenset()), buffers)

    for line in text.splitlines():
        header = _CLASS_LINE.fullmatch(line)
        if header:
            close()
            name, bases, lists, annotations = header.group(1), header.group(2) or "", {}, {}
            continue
        listed = _LIST_LINE.fullmatch(line)
        if name is not None and listed:
            try:
                names = ast.literal_eval(listed.group(2))  # a list of string literals, read as a literal only
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                names = None
            if type(names) is not list or not all(type(n) is str for n in names):
                raise _Refused(f"a class {name} in {where} whose {listed.group(1)} is not a list of names")
            lists[listed.group(1)] = frozenset(names)
            continue
        member = _MEMBER_LINE.fullmatch(line)
        if name is not None and member:
            annotations[member.group(1)] = member.group(2)
    close()
    return found


class _Archive:
    """The records of one archive, opened once and checked before any is read."""

    def __init__(self, archive: zipfile.ZipFile, size: int) -> None:
        self.zip, self.size = archive, size
        infos = archive.infolist()
        pickles = [i.filename for i in infos if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise _Refused("no data.pkl (it is not a TorchScript archive)")
        self.prefix = pickles[0][: -len("data.pkl")]
        self.infos = {i.filename: i for i in infos}
        _check_layout(infos)
        self.files: dict[str, dict[str, _ClassDecl]] = {}
        self.storages: dict[str, Tensor] = {}
        self.storage_bytes = 0
        self.code_bytes = 0

    def read(self, name: str, limit: int, stored: bool = True) -> bytes:
        info = self.infos.get(self.prefix + name)
        if info is None:
            raise _Refused(f"no record {_shown(name)}")
        if stored and info.compress_type != zipfile.ZIP_STORED:
            raise _Refused(f"a compressed record {_shown(name)} (torch.jit.save stores it as it is)")
        if info.file_size > limit:
            raise _Refused(f"a record {_shown(name)} of {info.file_size} bytes")
        return self.zip.read(info)

    def storage(self, ref: _StorageRef) -> Tensor:
        found = self.storages.get(ref.key)
        if found is None:
            nbytes = ref.numel * torch.empty((), dtype=ref.dtype).element_size()
            self.storage_bytes += nbytes
            if self.storage_bytes > self.size:  # records that share bytes: more tensor data than the file holds
                raise _Refused(f"more tensor data than the file's {self.size} bytes")
            data = self.read(f"data/{ref.key}", nbytes)
            if len(data) != nbytes:
                raise _Refused(f"a record data/{ref.key} of {len(data)} bytes for {nbytes} bytes of tensor")
            found = torch.frombuffer(bytearray(data), dtype=ref.dtype) if nbytes else torch.empty(0, dtype=ref.dtype)
            self.storages[ref.key] = found
        elif found.dtype != ref.dtype:
            raise _Refused(f"storage record data/{ref.key} used as {found.dtype} and {ref.dtype}")
        return found

    def tensor(self, ref: _TensorRef) -> Tensor:
        return self.storage(ref.storage).as_strided(ref.size, ref.stride, ref.offset)

    def declaration(self, qualified: str) -> _ClassDecl:
        """Whether ``qualified`` is a module, and the parameters and buffers its ``code/`` file declares."""
        module, _, name = qualified.rpartition(".")
        where = "code/" + module.replace(".", "/") + ".py"
        if where not in self.files:  # each file read once, however many classes it holds
            text = self.read(where, MAX_CODE_BYTES, stored=False).decode("utf-8", "replace")
            self.code_bytes += len(text)
            if self.code_bytes > MAX_CODE_TOTAL:
                raise _Refused(f"more than {MAX_CODE_TOTAL} bytes of class files")
            self.files[where] = _declarations(text, where)
        decl = self.files[where].get(name)
        if decl is None:
            raise _Refused(f"no declaration of class {_shown(qualified)} in its code file")
        return decl


def _check_layout(infos: list[zipfile.ZipInfo]) -> None:
    """Refuse what ``torch.jit.save`` never writes and a crafted zip uses against its reader: encrypted or
    exotically compressed records, and records whose bytes overlap (one stretch of the file read as many)."""
    end = -1
    for info in sorted(infos, key=lambda i: i.header_offset):
        if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise _Refused(f"a record {_shown(info.filename)} that is encrypted or compressed in an unusual way")
        if info.header_offset < end:
            raise _Refused(f"records that overlap ({_shown(info.filename)})")
        end = info.header_offset + 30 + len(info.filename.encode()) + info.compress_size


def _state_dict(archive: _Archive, root: Any) -> dict[str, Tensor]:
    """The module tree's parameters and buffers in ``nn.Module.state_dict`` order: a module's own parameters,
    then its buffers, each in attribute order, then each submodule's."""
    state: dict[str, Tensor] = {}
    seen: set[int] = set()

    def walk(obj: _ScriptObject, prefix: str, depth: int) -> None:
        if depth > MAX_MODULE_DEPTH:
            raise _Refused(f"modules nested more than {MAX_MODULE_DEPTH} deep")
        if id(obj) in seen:
            raise _Refused(f"a module ({_shown(prefix) or 'the root'}) that appears twice in the tree")
        seen.add(id(obj))
        decl = archive.declaration(obj.qualified_name)
        if not decl.module:
            raise _Refused(f"{_shown(prefix) or 'the root'}: an object of class {_shown(obj.qualified_name)}")
        for kind, only_tensors in ((decl.parameters, False), (decl.buffers, True)):
            for name, value in obj.attributes.items():
                if name not in kind or value is None:
                    continue
                if type(value) is not _TensorRef:
                    if only_tensors:
                        raise _Refused(f"{_shown(prefix + name)}: a {type(value).__name__} declared as a tensor")
                    continue  # torch keeps a parameter only while it holds a tensor
                state[prefix + name] = archive.tensor(value)
        for name, value in obj.attributes.items():
            if type(value) is _ScriptObject and archive.declaration(value.qualified_name).module:
                walk(value, f"{prefix}{name}.", depth + 1)

    if type(root) is not _ScriptObject:
        raise _Refused(f"a {type(root).__name__} at the top, not a module")
    walk(root, "", 0)
    return state


def read_jit_state(path: str | Path) -> dict[str, Tensor]:
    """The parameters and buffers of the TorchScript module in ``path``, as the ``state_dict`` of the module
    ``torch.jit.load`` would build, read without running anything the archive holds. An archive that holds
    anything but modules, tensors and plain data, or that is damaged, raises a one-line :class:`CheckpointError`
    naming the file."""
    path = Path(path)
    try:
        handle = open_regular(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        raise CheckpointError(why_unreadable(path, err)) from None
    with handle:
        try:
            with zipfile.ZipFile(handle) as archive:
                reader = _Archive(archive, os.fstat(handle.fileno()).st_size)
                if reader.prefix + "byteorder" in reader.infos and reader.read("byteorder", 16) != b"little":
                    raise _Refused("tensors stored in another byte order than little-endian")
                root = _PickleMachine(reader.read("data.pkl", MAX_PICKLE_BYTES)).run()
                return _state_dict(reader, root)
        except _Refused as err:
            raise CheckpointError(
                one_line(
                    f"refusing to load {path}: it holds {err}. A TorchScript tokenizer file holds only modules and "
                    "their tensors, and nothing else in it is ever run; use the official files or one you trust"
                )
            ) from None
        except Exception as err:  # noqa: BLE001 - zipfile, zlib, pickletools and torch raise many types on damage
            raise CheckpointError(
                one_line(
                    f"cannot read {path}: {type(err).__name__}: {str(err)[:160]}. The file looks truncated or damaged, "
                    "or is not a TorchScript archive; download it again (compare its size with the published one)."
                )
            ) from None
