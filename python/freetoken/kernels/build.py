"""Our C kernels (csrc/) compiled with the system's C compiler at first use, kept in the cache
folder by a hash of their source, and opened through ctypes with their functions declared from
csrc/kernels.h: each signature is written once, there, and read here for the argument types.

Where a library cannot run (no C compiler, a CPU its `*_supported` function refuses, or
FREETOKEN_NO_KERNELS set), `open_library` returns None and says why in the log; the wrappers
(grouped_gemm.py, pool_attention.py, quant.py, int8.py, bf16_linear.py, decoder_layer.py) load through it
once each, and kernels/plan.py records what loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from freetoken import envs
from freetoken.paths import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
HEADER = CSRC / "kernels.h"
# -ffp-contract=off: no multiply and add fused where the source does not ask for it (rotate_*
# rounds as torch does). -fopenmp links libgomp.so.1, which resolves to the copy torch loaded.
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


def source(name: str) -> Path:
    """The C file of library `name` (grouped_gemm, pool_attention, quant_gemm, int8_gemm,
    bf16_linear, decoder_layer)."""
    return CSRC / f"{name}.c"


def source_bytes(path: Path) -> bytes:
    """What a library is built from: its file and the header every file includes."""
    return path.read_bytes() + HEADER.read_bytes()


def build(path: Path) -> Path:
    """Compile a kernel source once per content into the cache folder (atomic: concurrent first
    uses each compile to their own file and keep whichever lands)."""
    compiler = shutil.which(envs.CC.get() or "cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    digest = hashlib.sha256(source_bytes(path) + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{path.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    command = [compiler, *FLAGS, "-o", str(tmp), str(path)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise OSError(f"{compiler} failed: {exc.stderr.strip()[-500:]}") from exc
    os.replace(tmp, target)
    return target


def open_library(name: str, supported: str, needs: str, instead: str) -> ctypes.CDLL | None:
    """Library `name` built and opened, every function of kernels.h it exports declared; None
    where it cannot run here (logged: call it once, from a cached loader): FREETOKEN_NO_KERNELS
    set, no C compiler, or a CPU on which its `supported` function returns 0 (it lacks `needs`).
    `instead`: what runs then."""
    if envs.NO_KERNELS.get():
        return None
    path = source(name)
    try:
        lib = ctypes.CDLL(str(build(path)))
    except OSError as exc:  # FileNotFoundError too: no compiler
        log.warning("%s unavailable (%s); %s", path.name, exc, instead)
        return None
    if not getattr(lib, supported)():
        log.info("this CPU lacks %s, which %s needs; %s", needs, path.name, instead)
        return None
    for function, (restype, argtypes) in declarations().functions.items():
        if hasattr(lib, function):  # the header declares every library's functions
            getattr(lib, function).argtypes, getattr(lib, function).restype = argtypes, restype
    return lib


def address(lib: ctypes.CDLL | None, function: str) -> int | None:
    """A function's address (decoder_layer.c calls it through `struct kernels`), None without lib."""
    return None if lib is None else ctypes.cast(getattr(lib, function), ctypes.c_void_p).value


# ---------------------------------------------------------------- reading kernels.h

_SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
_RETURNS = {"void": None, "int": ctypes.c_int}
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_PROTOTYPE = re.compile(r"^(void|int) (\w+)\(([^)]*)\);", re.M)
_STRUCT = re.compile(r"^struct (\w+) \{(.*?)\};", re.M | re.S)
_ENUM = re.compile(r"^enum \{(.*?)\};", re.M | re.S)
# A field's type: a struct, a function pointer's `__typeof__(f)`, or a (const) C type.
_FIELD = re.compile(r"(struct \w+|__typeof__\(\w+\)|(?:const )?\w+)\s+(.+)", re.S)


@dataclass(frozen=True)
class Declarations:
    functions: dict[str, tuple[type | None, list]]  # name: restype, argtypes
    structs: dict[str, type[ctypes.Structure]]  # in the header's order, each a ctypes mirror
    enums: dict[str, int]


@cache
def declarations() -> Declarations:
    text = _COMMENT.sub("", HEADER.read_text())
    functions = {name: (_RETURNS[ret], [] if params.strip() == "void" else
                        [_ctype(param) for param in params.split(",")])
                 for ret, name, params in _PROTOTYPE.findall(text)}
    structs: dict[str, type[ctypes.Structure]] = {}
    for name, body in _STRUCT.findall(text):
        fields = []
        for statement in filter(None, (s.strip() for s in body.split(";"))):
            kind, declarators = _FIELD.fullmatch(statement).groups()
            for declarator in declarators.split(","):
                field = re.findall(r"\w+", declarator)[-1]
                ctype = (ctypes.c_void_p if "*" in declarator else structs[kind.split()[1]]
                         if kind.startswith("struct ") else _SCALARS[kind])
                fields.append((field, ctype))
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    enums = {k.strip(): int(v) for body in _ENUM.findall(text)
             for k, v in (item.split("=") for item in body.split(",") if item.strip())}
    return Declarations(functions, structs, enums)


def _ctype(param: str) -> type:
    """A parameter's ctypes type: any pointer an address, else its scalar."""
    if "*" in param:
        return ctypes.c_void_p
    return _SCALARS[param.split()[-2]]
