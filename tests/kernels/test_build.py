"""kernels/build.py's reading of csrc/kernels.h against the C compiler's: every struct mirror has
the C struct's size and each field its offset, and every prototype's argument count is the one
the compiler sees."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from freetoken.kernels import build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")


def test_the_mirrors_and_argument_lists_are_the_compilers(tmp_path):
    declared = build.declarations()
    lines = [f'printf("%zu\\n", sizeof(struct {name}));' for name in declared.structs]
    lines += [f'printf("%zu\\n", offsetof(struct {name}, {field}));'
              for name, mirror in declared.structs.items() for field, _ in mirror._fields_]
    # A call with one argument too many or too few does not compile: each prototype's count.
    calls = [f"(void)sizeof({name}({', '.join(['0'] * len(argtypes))}));"
             for name, (_, argtypes) in declared.functions.items()]
    program = tmp_path / "sizes.c"
    program.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"kernels.h\"\n"
                       "int main(void) {\n" + "\n".join(lines + calls) + "\nreturn 0;\n}\n")
    binary = tmp_path / "sizes"
    compiler = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([compiler, "-Werror=implicit-function-declaration", f"-I{build.CSRC}", "-o", str(binary),
                    str(program)], check=True, capture_output=True)
    values = [int(v) for v in subprocess.run([str(binary)], check=True, capture_output=True,
                                             text=True).stdout.split()]
    expected = [ctypes.sizeof(mirror) for mirror in declared.structs.values()]
    expected += [getattr(mirror, field).offset for mirror in declared.structs.values() for field, _ in mirror._fields_]
    assert values == expected
    assert len(declared.functions) >= 30 and set(declared.structs) == {"kernels", "linear", "experts_weight", "moe", "layer", "step"}
