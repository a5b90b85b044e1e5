"""FreeToken: a compact OpenAI-compatible LLM server with its own torch engine."""

from freetoken import envs

# Before anything loads torch: its OpenMP runtime reads the setting once, as it loads.
envs.bound_openmp_spin()

from freetoken.core import SamplingParams  # after the setting: nothing may load torch before it

# Kept equal to pyproject.toml's version (tests/test_cli.py checks); `freetoken --version` reads
# the installed metadata first.
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Importing the engine pulls in torch; keep `import freetoken` cheap for the CLI.
    if name == "LLM":
        from freetoken.llm import LLM

        return LLM
    raise AttributeError(name)
