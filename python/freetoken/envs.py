"""Every environment variable freetoken reads, declared once: its name, the values it takes and
why it exists. Nothing else in the package reads the environment.

They are escape hatches and test switches, read when a model loads (never in a step; four are the
defaults of flags, config.WeightsConfig.resolved): a spawned
engine process inherits them, and the suite sets some for every load (tests/conftest.py). Other
programs' variables that change what a kernel computes (oneDNN's, MKL's, torch's ISA caps) are
named here too: the kernel probe keys its cache on them. A leaf: it imports nothing of
freetoken's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Env:
    name: str
    doc: str  # its values and what they do (its reader checks them, naming the variable)

    def get(self) -> str | None:
        """The value set; None where unset or empty."""
        return os.environ.get(self.name) or None


CACHE = Env("FREETOKEN_CACHE", "where built kernels, GGUF config folders and kernel probes are kept "
            "(default ~/.cache/freetoken)")
NO_KERNELS = Env("FREETOKEN_NO_KERNELS", "any value: build and open none of our C kernels; the "
                 "layers run on torch's (for a machine without a C compiler the same happens by itself)")
QUANT_ISA = Env("FREETOKEN_QUANT_ISA", "avx2: cap the quantized kernel at its AVX2 path (tests and "
                "benchmarks compare the paths)")
LINEAR_KERNEL = Env("FREETOKEN_LINEAR_KERNEL", "the one linear-kernel candidate the load-time probe "
                    "may choose (benchmarks, tests; layers/linear.py's CANDIDATES)")
LAYER_KERNEL = Env("FREETOKEN_LAYER_KERNEL", "0: decoder layers on the Python path, never the one-call "
                   "C layer (tests and benchmarks compare the two)")
GGUF_WEIGHTS = Env("FREETOKEN_GGUF_WEIGHTS", "what a GGUF's block formats become: quantized (kept as "
                   "stored) or float32 (dequantized at load); unset, by the dtype")
EXACT_TP = Env("FREETOKEN_EXACT_TP", "1: one process computes its sliced layers as two tensor-parallel "
               "ranks would, always; 0: never; unset: where that costs about nothing")
HUGE_PAGES = Env("FREETOKEN_HUGE_PAGES", "0: a GGUF's quantized weights stay on the file's map, not "
                 "copied into transparent huge pages")
HUB_PROGRESS_BARS = Env("HF_HUB_DISABLE_PROGRESS_BARS", "huggingface_hub's own switch, set by "
                        "freetoken where stderr is no terminal (spawned processes inherit it)")
CC = Env("CC", "the C compiler the kernels are built with (default cc, else gcc)")
# libgomp's own (torch's OpenMP runtime, which our kernels share), read when torch loads it.
SPIN_COUNT = Env("GOMP_SPINCOUNT", "turns an OpenMP thread spins waiting before it sleeps; set to "
                 "1000 by `import freetoken` where it and OMP_WAIT_POLICY are unset (libgomp's own: 300000)")
WAIT_POLICY = Env("OMP_WAIT_POLICY", "OpenMP's: PASSIVE threads sleep at once, ACTIVE spin; set, "
                  "freetoken leaves GOMP_SPINCOUNT unset")
# Other libraries' ISA caps: each changes which instructions a library kernel runs, so the probe's
# verdict of a machine is kept per value (layers/kernel_choice.py).
ISA_CAPS = tuple(Env(name, "an ISA cap of oneDNN, MKL or torch") for name in (
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY"))


def bound_openmp_spin() -> None:
    """Set GOMP_SPINCOUNT to 1000 turns where neither it nor OMP_WAIT_POLICY is set; to be run
    before torch loads libgomp. libgomp's own 300,000 turns are milliseconds, in which a waiting
    thread that shares its core with another busy process holds that core from the partner it
    waits for: decode beside a process burning one core fell to 0.12-0.26x of its speed without
    it, 0.45x and more with 1,000 turns, 0.24-0.66x with 10,000 (docs/performance.md, "Shared
    machines"); processes spawned after inherit it."""
    if SPIN_COUNT.get() is None and WAIT_POLICY.get() is None:
        os.environ[SPIN_COUNT.name] = "1000"


def quiet_hub_progress_bars() -> None:
    """Set HF_HUB_DISABLE_PROGRESS_BARS where unset: processes spawned after read it too."""
    os.environ.setdefault(HUB_PROGRESS_BARS.name, "1")
